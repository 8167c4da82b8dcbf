"""The files of one save: every rank writes what it owns of each dist checkpoint, hashing
the bytes as they go out and fsyncing each file, in the calling thread (a synchronous save)
or a background one (`background.BackgroundSave`).

A megatron dist checkpoint save is three phases: a plan agreed by every rank (which rank
writes which shard: collectives), the files (each rank its own, no collective), and a
finalization agreed again (the global metadata, rank 0, after gathering every rank's
write results). megatron-core returns the first phase's result as an `AsyncRequest`
(`dist_checkpointing.save(..., async_sharded_save=True)`); `ShardWrites` runs it:

* `add` (with every rank): the plan; with `copy` (a background save: training changes the
  live tensors in place meanwhile), one copy in host memory of what this rank writes: the
  device-to-host copy on a GPU, a clone on a CPU of each tensor megatron's plan did not
  clone already (it clones the views it writes from);
* `write` (no collective; megatron's own writer without the processes it forks): each of
  this rank's files written item by item with torch DCP's item writer, its bytes hashed
  (`checksums.HashedStream`) as they go out, then fsynced; no file is read back;
* `finish` (with every rank, in the training thread): megatron's finalization, then rank 0
  hashes and fsyncs the small files it wrote itself (`.metadata`, `common.pt`,
  `metadata.json`: kilobytes, in its page cache). Returns this rank's files with their
  sizes and checksums, for COMPLETE (`commit.Writer.record`).

Host memory: a synchronous save on a CPU holds megatron's clones of the views it writes
(the dense optimizer partition, `zero_state`) until written; on a GPU one tensor at a time.
A background save holds one copy of everything this rank writes until written.
"""

from __future__ import annotations

import os
import queue
import re
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import SerializationFormat, _write_item

from megatron_stem.checkpoint import checksums
from megatron_stem.checkpoint.strategy import parallel_save_strategy
from megatron_stem.runtime.mcore_versions import ASYNC_SAVE_ARGS

SHARD_FILE = re.compile(r"^__\d+_\d+\.distcp$")  # a rank's file; the others are rank 0's


class WriteFailed(Exception):
    """Another rank's files could not be written (torch's CheckpointException is a
    BaseException, which an ordinary handler would let through)."""


class ShardWrites:
    """This rank's part of the dist checkpoints of one save."""

    def __init__(self, copy: bool = False):
        self.copy = copy
        self._requests = []  # (megatron's request, its folder, this rank's write buckets)
        self._written: dict[Path, dict] = {}
        self._failure = None

    def add(self, sharded_state_dict: dict, folder: Path) -> None:
        """Plan the save of `sharded_state_dict` into `folder` (with every rank); with
        `copy`, copy what this rank writes to host memory."""
        live = {t.untyped_storage().data_ptr() for t in _tensors(sharded_state_dict)}
        request = dist_checkpointing.save(sharded_state_dict, str(folder),
                                          sharded_strategy=parallel_save_strategy(),
                                          async_sharded_save=True, **ASYNC_SAVE_ARGS)
        buckets = request.async_fn_args[1] if request.async_fn is not None else None
        if buckets is not None and self.copy:
            buckets = _host_copies(buckets, live)
        self._requests.append((request, Path(folder), buckets))

    def write(self) -> None:
        """Write, hash and fsync this rank's files (no collective: any thread). A failure
        is kept for `finish`, which every rank reaches."""
        try:
            for request, _, buckets in self._requests:
                if buckets is not None:
                    _, _, results = request.async_fn_args
                    self._written.update(_write_buckets(request.async_fn.args[0], buckets,
                                                        results))
        except BaseException as e:  # noqa: BLE001 (raised in the training thread by `finish`)
            self._failure = e

    def finish(self, folder: Path) -> dict[str, dict]:
        """Finalize with every rank (megatron's metadata, which raises on every rank if any
        rank's writes failed; rank 0 hashes and fsyncs the files it wrote): {name under
        `folder`: {"bytes", "xxh3_64"}} of the files this rank wrote, each durable."""
        try:
            for request, _, _ in self._requests:
                for finalize in request.finalize_fns:
                    finalize()
        except CheckpointException as e:  # some rank's writes failed: this one's, if it is
            raise self._failure or WriteFailed(str(e)) from None
        if self._failure is not None:
            raise self._failure
        written = dict(self._written)
        if not dist.is_initialized() or dist.get_rank() == 0:
            for _, dist_folder, _ in self._requests:
                written.update((path, checksums.entry_of(path, fsync=True))
                               for path in sorted(dist_folder.iterdir())
                               if path.is_file() and not SHARD_FILE.match(path.name))
        return {str(path.relative_to(folder)): entry for path, entry in written.items()}


def _tensors(sharded_state_dict: dict) -> list[torch.Tensor]:
    return [sh.data for sh in nested_values(sharded_state_dict)
            if isinstance(getattr(sh, "data", None), torch.Tensor)]


def _host_copies(buckets: list, live: set[int]) -> list:
    """megatron's write buckets with each tensor that training may change (on a device, or
    on the host in one of the `live` storages) replaced by its own copy in host memory;
    megatron's clones are private already."""
    def own(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "cpu" or tensor.untyped_storage().data_ptr() in live:
            return tensor.detach().to("cpu", copy=True)
        return tensor
    return [(path, key, (data, [(item, own(tensor)) for item, tensor in tensors]))
            for path, key, (data, tensors) in buckets]


def _write_buckets(transforms: list, buckets: list, results: queue.Queue) -> dict[Path, dict]:
    """What megatron's `write_preloaded_data` does, one bucket (file) after another in this
    thread, with each file hashed as it is written and fsynced; then the write results (or
    the first error) go where megatron's finalization reads them. {file: its entry}."""
    out, written = {}, {}
    try:
        for index, (path, storage_key, (byte_items, tensor_items)) in enumerate(buckets):
            with open(path, "wb") as f:
                stream, out[index] = checksums.HashedStream(f), []
                for item, data in [*byte_items, *tensor_items]:
                    if isinstance(data, torch.Tensor) and not data.is_cpu:
                        data = data.to("cpu")  # a synchronous save on a GPU: one at a time
                    out[index].append(_write_item(
                        *transforms, stream, data, item, storage_key,
                        serialization_format=SerializationFormat.TORCH_SAVE))
                f.flush()
                os.fsync(f.fileno())
                written[Path(path)] = stream.entry()
    except Exception as e:
        results.put(e)
        raise
    results.put(out)
    return written

