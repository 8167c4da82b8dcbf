"""Build DeepSpeed's JIT ops now, instead of during the first training run.

    python tools/build_ops.py

Compiles what training loads (DeepSpeed's CPU Adam, the tables' row Adam built from its
source; on CPU also DeepSpeed's shared-memory collectives), a minute or two each, and the
data cache's blend (a second), into the folder every run of this environment then loads
them from (see megatron_stem/runtime/jit_ops.py). Run it once after `pip install`; a second run
finds them built and returns at once.

    python tools/build_ops.py --within 90

gives the build 90 s in a child process: if it does not finish, it is killed, one line
says the run uses the torch kernel (`optimizer.tables.kernel: torch`), and the exit
status is 3 (bench/gpu/run_all.sh then passes that kernel on).
"""

import argparse
import sys

from megatron_stem.runtime import jit_ops
from megatron_stem.runtime.errors import cli


@cli
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--within", type=float, metavar="SECONDS",
                        help="kill a build that takes longer; exit 3 (use the torch kernel)")
    args = parser.parse_args(argv)
    if args.within is not None and not jit_ops.build_all_within(args.within):
        return 3
    built = jit_ops.build_all()
    from megatron_stem.data import blend

    built.append(blend.kernel().__name__)
    print(f"ready in {jit_ops.extensions_dir()}: {', '.join(built)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
