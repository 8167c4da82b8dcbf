"""Checkpoint files written in the background while training goes on (`train.async_save`).

A megatron dist checkpoint save is three phases: a plan agreed by every rank (which rank
writes which shard: collectives), the files (each rank its own, no collective), and a
finalization agreed again (the global metadata, rank 0, after gathering every rank's
write results). megatron-core returns the first phase's result as an `AsyncRequest`
(`dist_checkpointing.save(..., async_sharded_save=True)`); this module runs it:

* `add` (the step waits): the plan, then a copy in host memory of every tensor this rank
  writes: the device-to-host copy on a GPU, a clone on a CPU (training changes the live
  tensors in place while the files are written);
* `start`: the files, in a thread that only writes the copies and fsyncs each file
  (megatron's own writer, `FileSystemWriterAsync.write_preloaded_data`, without the
  processes it forks: the thread never touches a process group, so the training's
  collectives go on beside it);
* `written_everywhere` (a collective, once per step while a save is in flight) and
  `finish` (collectives, in the training thread, at a step boundary every rank reaches):
  megatron's finalization, every file fsynced, then the caller's commit.

A process killed before `finish` leaves files without the checkpoint's COMPLETE marker:
an interrupted save, which resume skips (`checkpoint/checkpointer.py`).
"""

from __future__ import annotations

import os
import queue
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from torch.distributed.checkpoint.api import CheckpointException

from megatron_stem.checkpoint.strategy import parallel_save_strategy
from megatron_stem.runtime import durable
from megatron_stem.runtime.mcore_versions import ASYNC_SAVE_ARGS
from megatron_stem.runtime.parallel import device


class WriteFailed(Exception):
    """Another rank's files could not be written (torch's CheckpointException is a
    BaseException, which an ordinary handler would let through)."""


class BackgroundSave:
    """The dist checkpoints of one training checkpoint, written by one thread."""

    def __init__(self):
        self._writes = []  # (request, host copies of its write buckets)
        self._thread = None
        self._failure = None

    def add(self, sharded_state_dict: dict, folder: Path) -> None:
        """Plan the save of `sharded_state_dict` into `folder` (with every rank) and copy
        what this rank writes to host memory."""
        request = dist_checkpointing.save(sharded_state_dict, str(folder),
                                          sharded_strategy=parallel_save_strategy(),
                                          async_sharded_save=True, **ASYNC_SAVE_ARGS)
        buckets = _host_copies(request.async_fn_args[1]) if request.async_fn else None
        self._writes.append((request, buckets))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._write, name="checkpoint-writer",
                                        daemon=True)
        self._thread.start()

    def _write(self) -> None:
        try:
            for request, buckets in self._writes:
                if request.async_fn is not None:
                    _, _, results = request.async_fn_args
                    _write_buckets(request.async_fn.args[0], buckets, results)
        except BaseException as e:  # noqa: BLE001 (raised in the training thread by `finish`)
            self._failure = e

    def written_here(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def written_everywhere(self, read):
        """Whether every rank's thread is done (a collective: every rank calls it), as a
        value of the step's host read `read` (runtime/host_read.py): true once read."""
        pending = torch.full((1,), 0.0 if self.written_here() else 1.0, device=device())
        if dist.is_initialized():
            dist.all_reduce(pending, op=dist.ReduceOp.MAX)
        return read.add(pending == 0)

    def finish(self, folder: Path) -> None:
        """Wait for this rank's files, then finalize with every rank (megatron's metadata,
        which raises on every rank if any rank's writes failed) and fsync every file and
        folder under `folder`. Afterwards the checkpoint may be committed."""
        self._thread.join()
        try:
            for request, _ in self._writes:
                for finalize in request.finalize_fns:
                    finalize()
        except CheckpointException as e:  # some rank's writes failed: this one's, if it is
            raise self._failure or WriteFailed(str(e)) from None
        if self._failure is not None:
            raise self._failure
        if dist.is_initialized():
            dist.barrier()
        if not dist.is_initialized() or dist.get_rank() == 0:
            fsync_tree(folder)


def _host_copies(buckets: list) -> list:
    """megatron's write buckets with each tensor replaced by its own copy in host memory."""
    return [(path, key, (data, [(item, tensor.detach().to("cpu", copy=True))
                                for item, tensor in tensors]))
            for path, key, (data, tensors) in buckets]


def _write_buckets(transforms: list, buckets: list, results: queue.Queue) -> None:
    """What megatron's `write_preloaded_data_multiproc` does in its forked processes, one
    bucket (file) after another in this thread: write and fsync each file, then put the
    write results (or the first error) where the finalization reads them."""
    found, count = queue.Queue(), queue.Queue()
    out = {}
    for i, bucket in enumerate(buckets):
        count.put(i)
        FileSystemWriterAsync.write_preloaded_data(transforms, i, bucket, found, count,
                                                   use_fsync=True)
        index, written = found.get()
        if isinstance(written, Exception):
            out = written
            break
        out[index] = written
    results.put(out)


def fsync_tree(folder: Path) -> None:
    """Make every file under `folder`, and the folders' entries, durable."""
    for root, dirs, files in os.walk(folder):
        for name in files:
            durable.fsync_path(os.path.join(root, name))
        durable.fsync_path(root)
