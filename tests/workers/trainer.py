"""The trainer's command line, as a torchrun rank runs it:

    trainer.py --recipe RECIPE [section.field=value ...]
"""

from megatron_stem import train
from megatron_stem.runtime import process_lifetime

if __name__ == "__main__":
    process_lifetime.exit_soon(train.main())
