"""A megatron model dist checkpoint (`iter_N/model/`), one tensor at a time.

On disk it is a torch.distributed.checkpoint (DCP) whose keys are the global,
layout-free names of `sharded_state_dict()`; each tensor is stored as the chunks its TP/PP
ranks held. `CheckpointReader.read` assembles one full tensor from its chunks, so a
converter's memory stays near the largest tensor whatever the model's size or the layout
that wrote it. `write_checkpoint` writes the same format tensor by tensor (each produced
only when DCP writes it), loadable by `checkpoint.load_model` at any TP/PP layout.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItemType

from megatron_stem.checkpoint.unpickling import SafeFileSystemReader
from megatron_stem.runtime.errors import UserError


class CheckpointReader:
    def __init__(self, folder: Path):
        if not (folder / ".metadata").is_file():
            raise UserError(f"{folder}: not a megatron dist checkpoint (no .metadata)")
        self.folder = folder
        self._reader = SafeFileSystemReader(str(folder))
        self._tensors = {k: v for k, v in self._reader.read_metadata().state_dict_metadata.items()
                         if isinstance(v, TensorStorageMetadata)}

    def keys(self) -> set[str]:
        return set(self._tensors)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._tensors[key].size)

    def dtype(self, key: str) -> torch.dtype:
        return self._tensors[key].properties.dtype

    def read(self, key: str) -> torch.Tensor:
        out = torch.empty(self.shape(key), dtype=self.dtype(key))
        # no_dist: a local read, also inside a job whose process group is up (its warning
        # that it assumes one process: runtime/warning_filters.py).
        dcp.load({key: out}, storage_reader=self._reader, no_dist=True)
        return out


class _LazySavePlanner(DefaultSavePlanner):
    """Plans from meta tensors; each real tensor is produced only when DCP writes it."""

    def __init__(self, producers: dict[str, Callable[[], torch.Tensor]]):
        super().__init__()
        self._producers = producers

    def resolve_data(self, write_item):
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        return self._producers[write_item.index.fqn]()


def _sharded_object(key: str, data) -> tuple[str, list]:
    """The DCP entry megatron writes for a ShardedObject of one shard (a module's
    `_extra_state`, None for our layers): the list of its shards' data (DCP torch.saves it)."""
    from megatron.core.dist_checkpointing import ShardedObject

    return ShardedObject(key, None, (1,), (0,), replica_id=0).unique_key, [data]


def _common_state_object(common: dict) -> tuple[str, io.BytesIO]:
    """megatron-core 0.19's `common_state` entry: as its save writes it, the list torch.saved
    into bytes (DCP would flatten a plain list, and drop an empty dict in it)."""
    key, data = _sharded_object("common_state", common)
    serialized = io.BytesIO()
    torch.save(data, serialized)
    return key, serialized


def write_checkpoint(folder: Path, tensors: dict[str, tuple[tuple[int, ...], torch.dtype,
                                                            Callable[[], torch.Tensor]]],
                     extra_state_keys: list[str]) -> None:
    """Write a megatron dist checkpoint of `tensors` (key -> global shape, dtype, producer)
    into the empty folder `folder`, in the format the installed megatron-core's
    `dist_checkpointing.save` writes (mcore_versions.COMMON_STATE_IN_SHARDS)."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

    from megatron_stem.runtime.mcore_versions import COMMON_STATE_IN_SHARDS

    folder.mkdir(parents=True, exist_ok=True)
    state = {k: torch.empty(shape, dtype=dtype, device="meta")
             for k, (shape, dtype, _) in tensors.items()}
    state.update(_sharded_object(k, None) for k in extra_state_keys)
    common = {}  # the non-sharded part of the state dict: empty for StemGPTModel
    if COMMON_STATE_IN_SHARDS:
        state.update([_common_state_object(common)])
    writer = dcp.FileSystemWriter(str(folder), single_file_per_rank=True, thread_count=1,
                                  per_thread_copy_ahead=0)  # no read-ahead: one tensor in flight
    dcp.save(state, storage_writer=writer, no_dist=True, planner=_LazySavePlanner(
        {k: produce for k, (_, _, produce) in tensors.items()}))
    if not COMMON_STATE_IN_SHARDS:
        torch.save(common, folder / "common.pt")
    save_config(CheckpointingConfig(sharded_backend="torch_dist", sharded_backend_version=1),
                str(folder))
