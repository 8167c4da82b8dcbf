"""What differs between the supported megatron-core versions (0.16.1 to 0.19.x), in one
place. Each difference is found from the installed package itself, not from its version
number, so a later patch release needs no change here.

- **An MLP's process groups.** Up to 0.17 a `TransformerLayer` builds an MLP class it does
  not list (ours) with only its config, and the MLP takes its TP group from
  `parallel_state`; from 0.18 it passes every MLP the layer's `pg_collection` (with
  `is_mtp_layer` and `name`): `mlp_tp_group`.
- **Where a checkpoint keeps its common state.** Up to 0.18 in `common.pt` beside the
  shards; from 0.19 inside them, as the sharded object `common_state`. 0.19 reads both;
  0.16.1-0.18 read only `common.pt` (docs/checkpoints.md, "Between megatron-core versions"):
  `COMMON_STATE_IN_SHARDS`.
- **Asynchronous saves.** From 0.17 `dist_checkpointing.save` takes `async_strategy`, whose
  default is NVIDIA's resiliency extension (`nvrx`, another package); the background save
  (`checkpoint/background.py`) runs megatron's own (`mcore`), the one 0.16.1 has:
  `ASYNC_SAVE_ARGS`.
- **Threads per rank of a save.** 0.16.1 writes each rank's shards with 2 threads (2 files),
  0.17 on with 1: `SAVE_THREADS` keeps 2 on every version, so a checkpoint's files, and what
  `tools/verify_checkpoint.py` lists, are the same whichever version wrote them.
"""

from __future__ import annotations

import dataclasses
import inspect
from importlib.metadata import version
from pathlib import Path
from typing import Optional

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import CheckpointingConfig

from megatron_stem.runtime.errors import UserError

SAVE_THREADS = 2

# 0.16.1-0.18 record the backend of `common.pt` in a checkpoint's metadata.json; 0.19 has none.
COMMON_STATE_IN_SHARDS = "common_backend" not in {
    f.name for f in dataclasses.fields(CheckpointingConfig)}

ASYNC_SAVE_ARGS = ({"async_strategy": "mcore"}
                   if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters
                   else {})


def mlp_tp_group(tp_group: Optional[torch.distributed.ProcessGroup],
                 pg_collection) -> Optional[torch.distributed.ProcessGroup]:
    """The TP group of an MLP built by a `TransformerLayer` of any supported version (None:
    `parallel_state`'s, which megatron's layers then take themselves)."""
    return pg_collection.tp if pg_collection is not None else tp_group


def check_readable(folder: Path) -> None:
    """Refuse, in one line, a dist checkpoint the installed megatron-core cannot read: one
    written by 0.19 or newer (no `common.pt`) read by 0.16.1-0.18, which would fail deep in
    megatron's load on the missing file."""
    if not COMMON_STATE_IN_SHARDS and not (folder / "common.pt").exists():
        raise UserError(
            f"{folder}: written by megatron-core 0.19 or newer, which keeps its common state "
            f"inside the shards; this environment's megatron-core {version('megatron-core')} "
            "reads only checkpoints with a common.pt: load it with megatron-core>=0.19 "
            "(docs/checkpoints.md, 'Between megatron-core versions')")
