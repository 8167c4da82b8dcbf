"""Check a megatron-stem checkpoint whole: every file there, at its size and checksum.

    python tools/verify_checkpoint.py --checkpoint runs/stem-1b/checkpoints [--all]

`--checkpoint` is a save dir (the checkpoint a resume would take: `latest`'s, else the
newest whole one, each refusal said in one line) or one iter_N folder; `--all` checks
every iter_N folder of a save dir. Exits 2 with one line naming the damaged file. It
reads every byte (xxh3_64): about the time a cold load takes. See docs/checkpoints.md.
"""

import argparse
import sys
import time
from pathlib import Path

from megatron_stem import checkpoint
from megatron_stem.runtime.errors import UserError, cli


def _verify(ckpt: Path) -> str:
    start = time.perf_counter()
    checkpoint.verify(ckpt)
    files = [p for p in ckpt.rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    return (f"ok: {ckpt} ({len(files)} files, {size / 1e9:.2f} GB, checksums match, "
            f"{time.perf_counter() - start:.1f} s)")


@cli
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, help="save dir or iter_N checkpoint folder")
    ap.add_argument("--all", action="store_true", help="every iter_N folder of a save dir")
    args = ap.parse_args(argv)
    if not args.all:
        print(_verify(checkpoint.resolve(args.checkpoint)))
        return 0
    folders = sorted(checkpoint.iter_folders(Path(args.checkpoint)), key=checkpoint.step_of)
    if not folders:
        raise UserError(f"{args.checkpoint}: no iter_N checkpoint folders in it")
    damaged = 0
    for ckpt in folders:
        try:
            print(_verify(ckpt))
        except UserError as e:
            print(f"damaged: {e}")
            damaged += 1
    return 2 if damaged else 0


if __name__ == "__main__":
    sys.exit(main())
