"""Import a Hugging Face model folder (a megatron-stem export, or a dense Llama such as
Llama-3.2-1B) as a megatron-stem checkpoint.

    python tools/from_hf.py --hf hf/stem_1b --save-dir runs/stem_1b_continued [--step 0]

writes `<save-dir>/iter_<step>/` (recipe.yaml, model dist checkpoint, COMPLETE) and
`latest`, loadable at any TP/PP layout. Model weights only: optimizer and data position
start afresh. Exporting the result again gives the same HF tensors bit for bit.
See docs/export.md.
"""

import argparse
import sys

from megatron_stem.runtime.errors import cli
from megatron_stem.hf.import_model import import_hf


@cli
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf", required=True,
                    help="Hugging Face model folder: a tools/to_hf.py export, or a "
                         "LlamaForCausalLM such as meta-llama/Llama-3.2-1B's")
    ap.add_argument("--save-dir", required=True,
                    help="the checkpoint save dir to write into (a recipe's train.init_from "
                         "names it)")
    ap.add_argument("--step", type=int, default=0,
                    help="iteration number of the checkpoint (default: %(default)s)")
    args = ap.parse_args(argv)
    out = import_hf(args.hf, args.save_dir, args.step)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
