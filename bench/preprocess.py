"""Preprocessing throughput for 1 and 2 workers vs the tokenizer's own encode rate.

    python bench/preprocess.py [--copies 4] [--workers 1 2] [--tokenizer-model M.model]

Runs side by side on the shipped corpus (data_corpus/gcide.jsonl.gz, repeated `--copies`
times as separate input files so that worker start-up is a small part of the run), once
as shipped (short dictionary entries: per-document costs weigh most) and once with
`--join` entries per document (lengths like web text's):

- raw encode: `Tokenizer.encode_batch` on the same texts, one thread, texts already in
  memory (the floor: nothing but tokenizing);
- the whole pipeline (`preprocess()`: decompress, parse, tokenize, write parts, merge)
  with each worker count.

The limit the pipeline is held to: tokenizer-bound, within 1.3x of raw encode time per
worker, i.e. wall x workers / encode <= 1.3. On a shared machine wall time also measures
the neighbours, so each figure is the best of `--repeat` runs and CPU time (workers +
main process) / encode CPU time is printed too.
Without --tokenizer-model a 4,096-piece SentencePiece model is trained first (as in the
quickstart).
"""

import argparse
import gzip
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

from megatron_stem.data.preprocess import PreprocessConfig, preprocess
from megatron_stem.data.tokenizer_training import TokenizerTrainingConfig, train_sentencepiece
from megatron_stem.tokenizer import load_tokenizer

CORPUS = Path(__file__).resolve().parent.parent / "data_corpus" / "gcide.jsonl.gz"


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def encode_rate(tokenizer, texts: list, batch: int = 1024) -> tuple[float, float, int]:
    """(wall s, CPU s, tokens) of encoding every text, in the pipeline's batch size."""
    wall, cpu, tokens = time.perf_counter(), time.process_time(), 0
    for i in range(0, len(texts), batch):
        tokens += sum(map(len, tokenizer.encode_batch(texts[i:i + batch])))
    return time.perf_counter() - wall, time.process_time() - cpu, tokens


def bench(texts: list, tmp: Path, name: str, copies: int, worker_counts: list,
          tokenizer_type: str, model: str, repeat: int) -> list:
    """Rows (name, wall, cpu, docs, tokens, MB, workers): raw encode, then the pipeline;
    the best of `repeat` runs each (on a shared machine the others are the neighbours')."""
    tokenizer = load_tokenizer(tokenizer_type, model)
    corpus, inputs = tmp / f"{name}.jsonl.gz", tmp / name
    with gzip.open(corpus, "wb") as f:
        f.writelines(json.dumps({"text": t}).encode() + b"\n" for t in texts)
    inputs.mkdir()
    for i in range(copies):  # separate input files, as a sharded corpus has
        (inputs / f"shard-{i:03d}.jsonl.gz").symlink_to(corpus)
    texts = texts * copies
    text_mb = sum(len(t.encode()) for t in texts) / 1e6

    runs = [encode_rate(tokenizer, texts) for _ in range(repeat)]
    tokens = runs[0][2]
    rows = [("raw encode, 1 thread", min(r[0] for r in runs), min(r[1] for r in runs),
             len(texts), tokens, text_mb, 1)]
    for workers in worker_counts:
        runs = []
        for i in range(repeat):
            out = tmp / f"{name}-out{workers}-{i}"
            cpu0, wall0 = children_cpu() + time.process_time(), time.perf_counter()
            stats = preprocess(PreprocessConfig(
                inputs=[str(inputs)], output_prefix=str(out / "corpus"),
                tokenizer_type=tokenizer_type, tokenizer_model=model, append_eod=True,
                workers=workers), log=None)
            runs.append((time.perf_counter() - wall0,
                         children_cpu() + time.process_time() - cpu0))  # workers reaped
            shutil.rmtree(out)
            if stats["tokens"] != tokens + len(texts):  # + one end-of-document each
                sys.exit("error: the pipeline's token count differs from the raw encode's")
        rows.append((f"preprocess, {workers} worker{'s' * (workers > 1)}",
                     min(r[0] for r in runs), min(r[1] for r in runs), stats["documents"],
                     stats["tokens"], stats["input_bytes"] / 1e6, workers))
    return rows


def print_table(title: str, rows: list) -> None:
    encode_wall, encode_cpu = rows[0][1], rows[0][2]
    print(f"\n{title}")
    print(f"{'':<24}{'wall s':>8}{'docs/s':>10}{'tokens/s':>12}{'MB/s':>8}{'CPU s':>8}"
          f"{'wall x workers':>16}{'CPU':>7}")
    print(f"{'':<24}{'':>8}{'':>10}{'':>12}{'':>8}{'':>8}{'/ encode':>16}{'/ enc':>7}")
    for name, wall, cpu, docs, toks, mb, workers in rows:
        print(f"{name:<24}{wall:>8.2f}{docs / wall:>10,.0f}{toks / wall:>12,.0f}"
              f"{mb / wall:>8.2f}{cpu:>8.2f}{wall * workers / encode_wall:>16.2f}"
              f"{cpu / encode_cpu:>7.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, default=4, help="input files, each the corpus")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--join", type=int, default=16,
                    help="second run: this many entries per document (web-like lengths)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each; the best is shown")
    ap.add_argument("--tokenizer-type", default="sentencepiece")
    ap.add_argument("--tokenizer-model", help="default: train a 4,096-piece model first")
    args = ap.parse_args()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread, as in the workers

    with gzip.open(CORPUS) as f:
        entries = [json.loads(line)["text"] for line in f]
    joined = ["\n\n".join(entries[i:i + args.join]) for i in range(0, len(entries), args.join)]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = args.tokenizer_model
        if model is None:
            model = train_sentencepiece(TokenizerTrainingConfig(
                inputs=[str(CORPUS)], output_prefix=str(tmp / "tok" / "gcide"), vocab_size=4096,
                threads=len(os.sched_getaffinity(0))), log=None)["model"]
        tables = [
            (f"{CORPUS.name} as shipped, x {args.copies} files: {len(entries) * args.copies:,} "
             f"docs of {sum(map(len, entries)) / len(entries):,.0f} chars on average",
             bench(entries, tmp, "entries", args.copies, args.workers, args.tokenizer_type,
                   model, args.repeat)),
            (f"the same text, {args.join} entries per doc: {len(joined) * args.copies:,} docs of "
             f"{sum(map(len, joined)) / len(joined):,.0f} chars (web-like lengths)",
             bench(joined, tmp, "joined", args.copies, args.workers, args.tokenizer_type,
                   model, args.repeat)),
        ]
        vocab = load_tokenizer(args.tokenizer_type, model).vocab_size
    print(f"tokenizer {Path(model).name} ({args.tokenizer_type}, vocab {vocab:,}); "
          f"{len(os.sched_getaffinity(0))} CPUs; best of {args.repeat} runs; limit: wall x "
          f"workers / encode <= 1.3; load average now {os.getloadavg()[0]:.1f}")
    for title, rows in tables:
        print_table(title, rows)


if __name__ == "__main__":
    main()
