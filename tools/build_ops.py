"""Build DeepSpeed's JIT ops now, instead of during the first training run.

    python tools/build_ops.py

Compiles what training loads (DeepSpeed's CPU Adam, the tables' row Adam built from its
source; on CPU also DeepSpeed's shared-memory collectives), a minute or two each, into the folder every run of this environment then
loads them from (see megatron_stem/ops.py). Run it once after `pip install`; a second run
finds them built and returns at once.
"""

import argparse
import sys

from megatron_stem import ops
from megatron_stem.errors import cli


@cli
def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    built = ops.build_all()
    print(f"ready in {ops.extensions_dir()}: {', '.join(built)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
