"""Write pre-tokenized MosaicML Streaming (MDS) datasets as Megatron .bin/.idx files.

    python tools/mds_to_megatron.py --input data/prolong_64k/raw \\
        --output-prefix data/prolong_64k/llama3/train --tokenizer-type huggingface \\
        --tokenizer-model tokenizers/llama3/tokenizer.json --append-eod

finds every index.json under --input (ProLong's princeton-nlp/prolong-data-64K: one per
domain and process folder), splits each sample's `input_ids` at its `indices` into
documents, and writes them in path order to <prefix>_text_document.{bin,idx}, the naming of
tools/preprocess_data.py. The tokenizer is the one the shards were made with: its
vocabulary sets the token dtype and bounds the ids, its end-of-text id ends each document
with --append-eod (document masking finds documents by it). See docs/data.md.
"""

import argparse
import sys

from megatron_stem.data import mds
from megatron_stem.runtime.errors import UserError, cli
from megatron_stem.data.tokenizer import load_setting


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input", nargs="+", required=True,
                    help="MDS dataset folders (searched for index.json) or index.json files")
    ap.add_argument("--output-prefix", required=True,
                    help="writes <prefix>_text_document.bin/.idx")
    ap.add_argument("--tokenizer-type", choices=["sentencepiece", "huggingface"], required=True)
    ap.add_argument("--tokenizer-model", required=True,
                    help="the tokenizer the shards' ids are of (a local file)")
    ap.add_argument("--append-eod", action="store_true",
                    help="end every document with the tokenizer's end-of-text id")
    ap.add_argument("--tokens-column", default="input_ids", help="the token ids' column")
    ap.add_argument("--documents-column", default="indices",
                    help="the column of [start, end) document bounds per sample; 'none': "
                         "each sample is one document")
    ap.add_argument("--log-interval", type=float, default=10.0,
                    help="seconds between progress lines in a log file")
    return ap.parse_args(argv)


@cli
def main(argv=None) -> int:
    args = parse_args(argv)
    tokenizer = load_setting("--tokenizer-model", args.tokenizer_type, args.tokenizer_model)
    if args.append_eod and tokenizer.eod is None:
        raise UserError(f"--append-eod: {args.tokenizer_model} names no end-of-text token")
    bounds = None if args.documents_column == "none" else args.documents_column
    prefix = f"{args.output_prefix}_text_document"
    stats = mds.convert(args.input, prefix, tokenizer.vocab_size,
                        tokenizer.eod if args.append_eod else None, args.tokens_column,
                        bounds, sys.stderr, args.log_interval)
    print(f"wrote {prefix}.bin/.idx: {stats['documents']:,} documents, {stats['tokens']:,} "
          f"tokens from {stats['shards']} shards")
    return 0


if __name__ == "__main__":
    sys.exit(main())
