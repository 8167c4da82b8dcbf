"""What a person reads: the warnings of other libraries that never concern a megatron-stem
user are dropped where they come from, and the other ranks of a job stay quiet.

`install` runs when the package is imported (`megatron_stem/__init__.py`): megatron-core
and DeepSpeed warn while they are being imported, so the filters must be in place before
any module of ours imports them, in every entry point and in the processes they spawn
(torchrun workers, megatron's checkpoint writer). Each filter names one message of one
library, never a whole category: anything else still shows, once per process.
"""

from __future__ import annotations

import logging
import os
import re
import warnings

# (message start, category, module): optional backends we never use (Apex, Transformer
# Engine), and deprecations inside the libraries themselves, which no setting of ours
# can act on.
IGNORED_WARNINGS = [
    ("Transformer Engine and Apex are not installed", UserWarning, r"megatron\.core\."),
    ("Apex is not installed", UserWarning, r"megatron\.core\."),
    ("full scope is deprecated", UserWarning, r"megatron\.core\.transformer\."),
    ("`torch.distributed.all_gather_into_tensor` is deprecated", FutureWarning,
     r"torch\.distributed\."),
    # torch's checkpoint reader and writer used in one process (checkpoint/streaming.py: the Hugging
    # Face conversions; megatron-core 0.19 reads every checkpoint's common state that way,
    # and calls the reader in its older argument order): the intent, not a mistake.
    ("torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to ",
     UserWarning, r"torch\.distributed\.checkpoint\."),
    ("The argument order of load has been changed", UserWarning,
     r"torch\.distributed\.checkpoint\."),
]
# logger name -> message starts: log records of the same kind.
IGNORED_LOGS = {
    # Training on CPU is what the recipe asked for; DeepSpeed guesses it was a mistake.
    "DeepSpeed": ("Setting accelerator to CPU. If you have GPU",),
    # The same with a CUDA build of torch on a machine without a GPU (a CPU run, a login
    # node): torch's JIT-build module says so as it is imported; the ops a CPU run builds
    # are CPU ops.
    "torch.utils.cpp_extension": ("No CUDA runtime is found",),
    # A failed checkpoint write, logged by the writer before it raises the same error
    # (which a full disk turns into one line: checkpoint.Writer).
    "megatron.core.dist_checkpointing.strategies.filesystem_async": ("Local process ",),
    # megatron-core 0.17+ runs every synchronous save through its built-in asynchronous
    # writer and says that writer is deprecated, even then; the background save uses it on
    # purpose (the other, `nvrx`, is another package: mcore_versions.ASYNC_SAVE_ARGS).
    "megatron.core.dist_checkpointing.strategies.torch": ("MCore's async save is deprecated",),
    # megatron-core 0.19 says at every model build that GPTModel, StemGPTModel's base, takes
    # only bug fixes now; its successor (HybridModel) is not in 0.16.1, the pinned version
    # (docs/development.md, "Supported versions").
    "megatron.core.models.gpt.gpt_model": ("GPTModel IS DEPRECATED",),
}
# Loggers of the libraries a job runs, quieted on ranks other than 0.
LIBRARY_LOGGERS = ("DeepSpeed", "megatron", "torch", "transformers")


class _DropMessages(logging.Filter):
    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.starts)


def install() -> None:
    """Drop the messages above (idempotent: a filter already there is not added again)."""
    for message, category, module in IGNORED_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=category,
                                module=module)
    for name, starts in IGNORED_LOGS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(starts))


def other_ranks_quiet() -> None:
    """Every rank of a job would print the same warnings: ranks other than 0 keep only
    errors (a failing rank still says why)."""
    if int(os.environ.get("RANK", "0")) == 0:
        return
    warnings.simplefilter("ignore")
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
