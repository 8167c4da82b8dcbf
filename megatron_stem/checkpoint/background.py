"""Checkpoint files written in the background while training goes on (`train.async_save`).

A save's files are `shard_writes.ShardWrites` (the plan and the finalization with every
rank; the files, hashed as written and fsynced, by one rank alone); here they are written
by a thread:

* `add` (the step waits): megatron's plan, then one copy in host memory of every tensor
  this rank writes (training changes the live tensors in place while the files are
  written);
* `start`: the files, in a thread that only writes the copies, hashing and fsyncing each
  file; it never touches a process group, so the training's collectives go on beside it;
* `written_everywhere` (a collective, once per step while a save is in flight) and
  `finish` (collectives, in the training thread, at a step boundary every rank reaches):
  megatron's finalization, then the caller's commit, which reads no file.

A process killed before `finish` leaves files without the checkpoint's COMPLETE marker:
an interrupted save, which resume skips (`checkpoint/checkpointer.py`).
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_stem.checkpoint.shard_writes import ShardWrites
from megatron_stem.runtime.parallel import device


class BackgroundSave(ShardWrites):
    """The dist checkpoints of one training checkpoint, written by one thread."""

    def __init__(self):
        super().__init__(copy=True)
        self._thread = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.write, name="checkpoint-writer",
                                        daemon=True)
        self._thread.start()

    def written_here(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def written_everywhere(self, read):
        """Whether every rank's thread is done (a collective: every rank calls it), as a
        value of the step's host read `read` (runtime/host_read.py): true once read."""
        pending = torch.full((1,), 0.0 if self.written_here() else 1.0, device=device())
        if dist.is_initialized():
            dist.all_reduce(pending, op=dist.ReduceOp.MAX)
        return read.add(pending == 0)

    def finish(self, folder: Path) -> dict[str, dict]:
        """Wait for this rank's files, then finalize with every rank (`ShardWrites.finish`):
        this rank's files with their sizes and checksums. Afterwards the checkpoint may be
        committed."""
        self._thread.join()
        return super().finish(folder)
