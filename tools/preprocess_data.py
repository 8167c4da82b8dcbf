"""Tokenize text shards into Megatron .bin/.idx files (parallel, streaming, resumable).

    python tools/preprocess_data.py --input 'corpus/*.jsonl.zst' --json-keys text \\
        --output-prefix data/corpus --tokenizer-type sentencepiece \\
        --tokenizer-model tokenizer/stem.model --append-eod --workers 16

writes the prefix set data/corpus_text_document/ (prefixes 00000-00000.bin/.idx, ... of at
most --prefix-max-tokens tokens, and manifest.json; --single-prefix: one
data/corpus_text_document.{bin,idx}, Megatron-LM's naming), data/corpus.stats.json and, when
records were skipped, data/corpus.errors.log. Rerunning an interrupted command resumes it.
See docs/data.md.
"""

import argparse
import os
import signal
import sys

from megatron_stem.data.prefix_sets import DEFAULT_MAX_DOCUMENTS, DEFAULT_MAX_TOKENS
from megatron_stem.data.preprocess import PreprocessConfig, format_summary, preprocess
from megatron_stem.runtime.errors import UserError, cli


def parse_args(argv=None) -> PreprocessConfig:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    io = ap.add_argument_group("input and output")
    io.add_argument("--input", nargs="+", required=True,
                    help="files, globs or folders of .jsonl/.json/.txt[.gz|.zst] or .parquet")
    io.add_argument("--json-keys", nargs="+", default=["text"],
                    help="text field(s) (Parquet: columns); one output per key")
    io.add_argument("--output-prefix", required=True,
                    help="writes the folder <prefix>_<key>_document/ (a prefix set: "
                         "prefixes and manifest.json) and <prefix>.stats.json")
    io.add_argument("--single-prefix", action="store_true",
                    help="write one <prefix>_<key>_document.bin/.idx instead of a prefix set "
                         "(small corpora)")
    io.add_argument("--prefix-max-tokens", default=DEFAULT_MAX_TOKENS,
                    metavar="N", help="close a prefix before the next part (a chunk's "
                                      "tokens) takes it past N tokens (default 20e9)")
    io.add_argument("--prefix-max-documents", default=DEFAULT_MAX_DOCUMENTS,
                    metavar="N", help="... or past N documents (default 2**30; at most "
                                      "2**31-1: megatron-core holds document ids as int32)")
    tok = ap.add_argument_group("tokenizer (local files only)")
    tok.add_argument("--tokenizer-type", required=True,
                     help="sentencepiece or huggingface (Megatron-LM's names also work)")
    tok.add_argument("--tokenizer-model", required=True,
                     help="SentencePiece .model, or Hugging Face tokenizer.json (or its folder)")
    tok.add_argument("--tokenizer-backend", choices=["auto", "gigatoken", "reference"],
                     default="auto",
                     help="gigatoken (several times faster, same ids) or the reference "
                          "sentencepiece/tokenizers; auto: gigatoken where it loads the model")
    tok.add_argument("--verify-tokenizer", type=int, default=32, metavar="N",
                     help="with gigatoken, first check that it gives the reference library's "
                          "ids on the run's first N documents (their first 2,048 characters; "
                          "0: do not)")
    tok.add_argument("--append-eod", action="store_true",
                     help="end every document with the tokenizer's end-of-document token")
    tok.add_argument("--prepend-bos", action="store_true",
                     help="start every document with the tokenizer's beginning-of-document "
                          "token (with --append-eod: BOS + text + EOS, as the official STEM "
                          "code's data)")
    run = ap.add_argument_group("running")
    run.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                     help="tokenizing threads (gigatoken) or processes (default: the CPUs "
                          "available)")
    run.add_argument("--on-error", choices=["skip", "fail"], default="skip",
                     help="bad records: count, log and skip them, or stop at the first")
    run.add_argument("--log-interval", type=float, default=10.0,
                     help="seconds between progress lines when not on a terminal")
    run.add_argument("--chunk-size-mb", type=float, default=None,
                     help="MiB of text per unit of work and of resume (default: a 16th of "
                          "each file, 1 to 8 MiB); the output does not depend on it")
    run.add_argument("--keep-parts", action="store_true",
                     help="keep <prefix>.parts/ (the per-chunk token files) after merging")
    array = ap.add_argument_group("SLURM arrays (see slurm/preprocess.sh)")
    array.add_argument("--num-groups", type=int, default=1,
                       help="split the input files into this many contiguous runs of about "
                            "equal bytes ...")
    array.add_argument("--group-index", type=int, default=0,
                       help="... and process only this one, writing its own prefixes "
                            "(then run --merge-only)")
    array.add_argument("--merge-only", action="store_true",
                       help="once every group is done: check their group files and write "
                            "manifest.json and the stats, copying nothing (--single-prefix: "
                            "merge every group's parts into the one prefix, resumably)")
    a = ap.parse_args(argv)
    return PreprocessConfig(
        inputs=a.input, output_prefix=a.output_prefix, tokenizer_type=a.tokenizer_type,
        tokenizer_model=a.tokenizer_model, json_keys=a.json_keys, append_eod=a.append_eod,
        prepend_bos=a.prepend_bos,
        workers=a.workers, tokenizer_backend=a.tokenizer_backend,
        verify_docs=a.verify_tokenizer, on_error=a.on_error,
        chunk_bytes=None if a.chunk_size_mb is None else int(a.chunk_size_mb * (1 << 20)),
        log_interval=a.log_interval, group_index=a.group_index, num_groups=a.num_groups,
        merge_only=a.merge_only, keep_parts=a.keep_parts, single_prefix=a.single_prefix,
        prefix_max_tokens=count("--prefix-max-tokens", a.prefix_max_tokens),
        prefix_max_documents=count("--prefix-max-documents", a.prefix_max_documents))


def count(flag: str, text) -> int:
    """A whole number, written plainly or as 20e9 or 2**30."""
    if isinstance(text, int):  # the default
        return text
    try:
        if "**" in text:
            base, power = text.split("**")
            return int(base) ** int(power)
        value = float(text)
        if value == int(value):
            return int(text) if text.strip().lstrip("+-").isdigit() else int(value)
    except (ValueError, OverflowError):
        pass
    raise UserError(f"{flag}: expected a whole number such as 20e9, got {text!r}")


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM (scancel, preemption) stops like Ctrl-C: cleanly


@cli
def main(argv=None) -> int:
    cfg = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        stats = preprocess(cfg)
    except KeyboardInterrupt:
        print("interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    print(format_summary(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
