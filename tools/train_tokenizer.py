"""Train a SentencePiece tokenizer from the same inputs preprocessing reads.

    python tools/train_tokenizer.py --input data_corpus/gcide.jsonl.gz \\
        --output-prefix tokenizer/gcide --vocab-size 4096

writes tokenizer/gcide.model (load it with --tokenizer-type sentencepiece), .vocab, and
.json (the sample and settings it was trained on). Special tokens: <unk> 0, <s> 1,
</s> 2 (end of document, what --append-eod appends), <pad> 3.
"""

import argparse
import os
import sys

from megatron_stem.data.tokenizer_training import TokenizerTrainingConfig, train_sentencepiece
from megatron_stem.runtime.errors import cli
from megatron_stem.data.tokenizer import load_tokenizer


def parse_args(argv=None) -> TokenizerTrainingConfig:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input", nargs="+", required=True,
                    help="files, globs or folders of .jsonl/.json/.txt[.gz|.zst] or .parquet")
    ap.add_argument("--json-keys", nargs="+", default=["text"], help="text field(s)")
    ap.add_argument("--output-prefix", required=True, help="writes <prefix>.model/.vocab/.json")
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    ap.add_argument("--max-docs", type=int, default=200_000,
                    help="documents sampled uniformly from the inputs (bounds memory)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                    help="SentencePiece training threads")
    ap.add_argument("--user-defined-symbols", nargs="*", default=[],
                    help="extra special tokens, never split (e.g. chat markers)")
    a = ap.parse_args(argv)
    return TokenizerTrainingConfig(
        inputs=a.input, output_prefix=a.output_prefix, vocab_size=a.vocab_size,
        json_keys=a.json_keys, model_type=a.model_type, max_docs=a.max_docs, seed=a.seed,
        threads=a.workers, user_defined_symbols=a.user_defined_symbols)


@cli
def main(argv=None) -> int:
    cfg = parse_args(argv)
    info = train_sentencepiece(cfg)
    tok = load_tokenizer("sentencepiece", info["model"])
    print(f"wrote {info['model']}: vocab {tok.vocab_size:,}, eod (</s>) {tok.eod}, "
          f"bos {tok.bos}, pad {tok.pad}; trained on {info['documents_sampled']:,} of "
          f"{info['documents_seen']:,} documents")
    return 0


if __name__ == "__main__":
    sys.exit(main())
