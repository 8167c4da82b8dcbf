"""Export a megatron-stem checkpoint as a Hugging Face model folder.

    python tools/to_hf.py --checkpoint runs/stem-1b/checkpoints --output hf/stem_1b \\
        [--dtype bf16] [--tokenizer tokenizer/stem.model]

`--checkpoint` is a save dir (its `latest` is exported) or one iter_N folder, written at
any TP/PP/DP layout. A STEM model loads with
`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`; a dense one is written
as transformers' own LlamaForCausalLM and needs no remote code. Tensors are streamed one
at a time: memory stays near the largest tensor. See docs/export.md.
"""

import argparse
import sys
import warnings

from megatron_stem.runtime.errors import cli
from megatron_stem.hf.export import DEFAULT_SHARD_BYTES, DTYPES, ExportWarning, export


@cli
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, help="save dir or iter_N checkpoint folder")
    ap.add_argument("--output", required=True, help="the HF model folder to create")
    ap.add_argument("--dtype", choices=sorted(DTYPES),
                    help="weight dtype of the export (default: as stored in the checkpoint)")
    ap.add_argument("--tokenizer",
                    help="SentencePiece .model or Hugging Face tokenizer.json to ship with it")
    ap.add_argument("--max-shard-gb", type=float, default=DEFAULT_SHARD_BYTES / 2**30,
                    help="largest safetensors file (a bigger tensor gets a file of its own)")
    args = ap.parse_args(argv)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ExportWarning)
        out = export(args.checkpoint, args.output, args.dtype, args.tokenizer,
                     int(args.max_shard_gb * 2**30))
    for w in caught:  # ours as one line each, anything else as Python shows it
        if issubclass(w.category, ExportWarning):
            print(f"warning: {w.message}", file=sys.stderr)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
