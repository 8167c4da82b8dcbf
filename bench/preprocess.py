"""Preprocessing: ours vs the fast path vs the reference libraries, per tokenizer kind.

    python bench/preprocess.py [--sizes-mb 100 1000] [--workers 2] [--repeat 2] \
        [--kinds sentencepiece huggingface]

For each size, a JSON Lines corpus of real English text is made under /tmp (the shipped
data_corpus/gcide.jsonl.gz, `--join` dictionary entries per document so that documents
have web-like lengths, repeated to the size; deleted afterwards), and two tokenizers are
trained on the shipped corpus (SentencePiece BPE with byte fallback, by
tools/train_tokenizer.py's trainer; a Hugging Face byte-level BPE tokenizer.json). Each
path then runs as its own process, ours and the fast path back to back in every repeat,
so that their ratio is measured under the same load:

- ours: tools/preprocess_data.py --workers W (gigatoken, streaming, resumable);
- fast path: gigatoken `encode_files` over the whole file (its own JSONL reader and
  W threads), then one .bin/.idx write: the speed limit, holding everything in memory
  (how Megatron-LM's preprocess_data_fast.py works);
- reference: tools/preprocess_data.py --tokenizer-backend reference (sentencepiece /
  tokenizers in W processes), once, on sizes up to `--reference-max-mb`.

Every path's .bin/.idx must be byte-identical to ours. Printed per path: the best wall
time of `--repeat` runs, MB/s, its ratio to the fast path's in the same repeat (the median
of those ratios and their range; ours runs first in even repeats, the fast path in odd
ones), the same for CPU time (user + system, of the process and its
children: on a busy machine wall time mostly measures the neighbours, CPU time much
less), and peak RSS (the largest process: ours is one process, the reference path's
workers are measured one by one), and the range of the load average (1 minute) seen
at the start of each run. The goal: ours <= the fast path in wall and in CPU time, with a
peak RSS that does not grow with the input.
"""

import argparse
import filecmp
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "data_corpus" / "gcide.jsonl.gz"
KINDS = ("sentencepiece", "huggingface")


# --- inputs ------------------------------------------------------------------------------


def make_corpus(path: Path, megabytes: float, join: int) -> int:
    """Write about `megabytes` MB of JSONL; return the number of documents."""
    with gzip.open(CORPUS) as f:
        entries = [json.loads(line)["text"] for line in f]
    lines = [json.dumps({"id": i, "text": "\n\n".join(entries[j:j + join])},
                        ensure_ascii=False).encode() + b"\n"
             for i, j in enumerate(range(0, len(entries), join))]
    size, docs, target = 0, 0, megabytes * 1e6
    with open(path, "wb") as f:
        while size < target:
            for line in lines:
                f.write(line)
                size, docs = size + len(line), docs + 1
                if size >= target:
                    break
    return docs


def train_tokenizers(folder: Path, vocab: int) -> dict:
    """{kind: model path}: the SentencePiece model by our trainer, and a byte-level BPE
    tokenizer.json by Hugging Face `tokenizers`, both on the shipped corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from megatron_stem.data.tokenizer_training import (TokenizerTrainingConfig,
                                                       train_sentencepiece)

    sp = train_sentencepiece(TokenizerTrainingConfig(
        inputs=[str(CORPUS)], output_prefix=str(folder / "sp"), vocab_size=vocab,
        threads=len(os.sched_getaffinity(0))), log=None)["model"]
    with gzip.open(CORPUS) as f:
        texts = [json.loads(line)["text"] for line in f]
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>", "<pad>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    (folder / "hf").mkdir()
    hf.save(str(folder / "hf" / "tokenizer.json"))
    return {"sentencepiece": sp, "huggingface": str(folder / "hf" / "tokenizer.json")}


# --- the fast path (run as its own process by `main`) ------------------------------------


def fast_path(corpus: str, prefix: str, kind: str, model: str) -> None:
    """gigatoken.encode_files over the whole file, then one .bin/.idx write."""
    import gigatoken
    import numpy as np

    from megatron_stem.data.indexed import PartWriter, token_dtype
    from megatron_stem.data.tokenizer import load_tokenizer

    tok = (gigatoken.Tokenizer.from_sentencepiece(model) if kind == "sentencepiece"
           else gigatoken.Tokenizer(model))
    eod = load_tokenizer(kind, model).eod
    layout = tok.encode_files(gigatoken.JsonlFileSource([corpus]), parallel=True).layout
    offsets = np.asarray(layout.offsets)
    flat = np.asarray(layout.content.data)[offsets[0]:offsets[-1]]
    lengths = np.diff(offsets)
    writer = PartWriter(prefix, token_dtype(tok.vocab_size))
    writer.add(np.insert(flat, np.cumsum(lengths), eod), lengths + 1)
    writer.close()


# --- running and measuring ---------------------------------------------------------------


LOADS = []  # the 1-minute load average at the start of each timed run


def timed(argv: list, env: dict) -> tuple[float, float, float]:
    """(wall s, CPU s, peak RSS MB of the largest process) of a child process and its
    own children."""
    LOADS.append(os.getloadavg()[0])
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, *argv], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)  # the rusage of this child alone
    wall = time.perf_counter() - start
    if status != 0:
        sys.exit(f"error: {' '.join(argv)} failed:\n{child.stderr.read().decode()}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def commands(kind: str, model: str, corpus: Path, out: Path, workers: int) -> dict:
    tool = [str(ROOT / "tools" / "preprocess_data.py"), "--input", str(corpus),
            "--tokenizer-type", kind, "--tokenizer-model", model, "--append-eod",
            "--workers", str(workers), "--log-interval", "1000", "--single-prefix"]
    return {
        "ours": tool + ["--output-prefix", str(out / "ours")],
        "fast path": [__file__, "fast-path", str(corpus), str(out / "fast_text_document"),
                      kind, model],
        "reference": tool + ["--output-prefix", str(out / "reference"),
                             "--tokenizer-backend", "reference"],
    }


def outputs(out: Path, name: str) -> Path:
    return out / {"ours": "ours_text_document", "fast path": "fast_text_document",
                  "reference": "reference_text_document"}[name]


def spread(ratios: list) -> str:
    """The median of the ratios, and their range when there are several."""
    median = f"{statistics.median(ratios):.2f}"
    return median if len(ratios) == 1 else f"{median} ({min(ratios):.2f}-{max(ratios):.2f})"


def bench_size(megabytes: float, models: dict, args, tmp: Path) -> list:
    corpus = tmp / f"corpus-{megabytes:g}MB.jsonl"
    docs = make_corpus(corpus, megabytes, args.join)
    size = corpus.stat().st_size / 1e6
    env = dict(os.environ, RAYON_NUM_THREADS=str(args.workers),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    rows = []
    for kind in args.kinds:
        out = tmp / f"out-{kind}"
        out.mkdir()
        cmds = commands(kind, models[kind], corpus, out, args.workers)
        names = ["ours", "fast path"] + (["reference"] if megabytes <= args.reference_max_mb
                                         else [])
        runs = {name: [] for name in names}
        for repeat in range(args.repeat):
            # Ours first in even repeats, the fast path first in odd ones; the reference
            # path once.
            order = names[:2] if repeat % 2 == 0 else names[1::-1]
            for name in order + (names[2:] if repeat == 0 else []):
                for stale in out.glob(f"{name.split()[0]}*"):  # ours would be up to date
                    stale.unlink()
                runs[name].append(timed(cmds[name], env))
        ours = outputs(out, "ours")
        for name in names[1:]:
            for ext in (".bin", ".idx"):
                if not filecmp.cmp(f"{ours}{ext}", f"{outputs(out, name)}{ext}", shallow=False):
                    sys.exit(f"error: {kind}: {name}'s {ext} differs from ours")
        fast = runs["fast path"]
        for name in names:
            walls, cpus, rss = zip(*runs[name])
            rows.append((f"{size:,.0f} MB", kind, name, min(walls), size / min(walls),
                         spread([w / f[0] for w, f in zip(walls, fast)]), min(cpus),
                         spread([c / f[1] for c, f in zip(cpus, fast)]), max(rss)))
        for path in out.iterdir():
            path.unlink() if path.is_file() else None
    corpus.unlink()
    print(f"{size:,.0f} MB corpus: {docs:,} documents", file=sys.stderr)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[100.0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2, help="runs of each path; best shown")
    ap.add_argument("--join", type=int, default=8,
                    help="dictionary entries per document (8: about 1.9 kB, web-like)")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS),
                    help="tokenizer kinds to run")
    ap.add_argument("--reference-max-mb", type=float, default=200,
                    help="run the reference path only on corpora up to this size (slow)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        tmp = Path(tmp)
        (tmp / "tok").mkdir()
        models = train_tokenizers(tmp / "tok", args.vocab)
        rows = []
        for megabytes in args.sizes_mb:
            (tmp / "run").mkdir()
            rows += bench_size(megabytes, models, args, tmp / "run")
            shutil.rmtree(tmp / "run")
    print(f"{len(os.sched_getaffinity(0))} CPUs, --workers {args.workers}, vocab "
          f"{args.vocab:,}, best of {args.repeat}; load average {min(LOADS):.1f} to "
          f"{max(LOADS):.1f} during the runs; all outputs byte-identical")
    print("| input | tokenizer | path | wall s | MB/s | wall / fast path's | CPU s "
          "| CPU / fast path's | peak RSS MB |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for size, kind, name, wall, rate, ratio, cpu, cpu_ratio, rss in rows:
        print(f"| {size} | {kind} | {name} | {wall:.2f} | {rate:.1f} | {ratio} | {cpu:.2f} "
              f"| {cpu_ratio} | {rss:,.0f} |")


if __name__ == "__main__":
    if sys.argv[1:2] == ["fast-path"]:
        fast_path(*sys.argv[2:])
    else:
        main()
