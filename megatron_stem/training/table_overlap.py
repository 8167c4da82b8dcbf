"""`tables.overlap: next_step`: a step's table update runs while the next step computes.

The table update of step k (CPU Adam over a rank's shard, then publishing the updated
rows to every rank) need not finish before step k+1 starts, only before step k+1 reads a
row it changes. So `TableOptimizer.step` splits each table's rows in two:

* the rows step k+1 looks up on any rank: updated and published first, table by table in
  forward order; a table's lookup in step k+1's forward waits for its own rows only (the
  table parameter's `pending_rows` callable, see `model/table.py`), so the tables of
  later layers are updated while earlier layers compute;
* every other row: updated and published after them, while step k+1 runs; nothing reads
  them before step k+2, and `TableOptimizer` waits for them (`finish`) before it takes
  step k+1's gradients, saves, or evaluates.

Semantics are unchanged (the same arithmetic on every row, in another order of rows), so
the loss curve is the one without overlap. The work runs on one background thread with
its own process group (collectives of two threads must not share a group) and, on a GPU,
its own stream; a table's rows are ready for the compute stream once an event recorded
after their all-gather has passed.
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import torch
import torch.distributed as dist


def clone_group(group):
    """A second process group over the ranks of `group` (None: the world), made on every
    rank (one per distinct group, in the same order everywhere, as torch requires)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    mine = dist.get_process_group_ranks(group or dist.group.WORLD)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    clone, _ = dist.new_subgroups_by_enumeration(sorted({tuple(r) for r in everyone}))
    return clone


class _Ready:
    """Set when a table's rows for the next forward are in place."""

    def __init__(self):
        self.event = threading.Event()
        self.cuda_event: Optional[torch.cuda.Event] = None
        self.error: Optional[BaseException] = None

    def set(self, stream: Optional[torch.cuda.Stream]) -> None:
        if stream is not None:
            self.cuda_event = torch.cuda.Event()
            self.cuda_event.record(stream)
        self.event.set()

    def wait(self) -> None:
        self.event.wait()
        if self.error is not None:
            raise RuntimeError("the overlapped table update failed") from self.error
        if self.cuda_event is not None:
            torch.cuda.current_stream().wait_event(self.cuda_event)


class Overlap:
    """Runs table update jobs on a background thread, in order, one step at a time."""

    def __init__(self, dp_group):
        self.group = clone_group(dp_group)
        self.cuda = torch.cuda.is_available()
        self.stream = torch.cuda.Stream() if self.cuda else None
        init = (lambda: torch.cuda.set_device(torch.cuda.current_device())) \
            if self.cuda else None
        self.worker = ThreadPoolExecutor(1, "stem-table-update", initializer=init)
        self._pending: Optional[Future] = None
        self._hooked: list[torch.nn.Parameter] = []

    def launch(self, first: list[tuple[torch.nn.Parameter, Callable]],
               rest: list[Callable]) -> None:
        """Run `first` (per table: the job that puts the rows the next forward needs in
        place), then `rest`, in the background. Each job gets this overlap's group. Until
        a table's first job is done, its lookups wait (`param.pending_rows`)."""
        self.finish()
        ready = [_Ready() for _ in first]
        for (param, _), r in zip(first, ready):
            param.pending_rows = r.wait
            self._hooked.append(param)
        if self.cuda:  # the updated rows' inputs were made on the compute stream
            self.stream.wait_stream(torch.cuda.current_stream())

        def run():
            try:
                with torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext():
                    for (_, job), r in zip(first, ready):
                        job(self.group)
                        r.set(self.stream)
                    for job in rest:
                        job(self.group)
            except BaseException as e:
                for r in ready:
                    r.error = r.error or e
                    r.event.set()
                raise

        self._pending = self.worker.submit(run)

    def finish(self) -> None:
        """Wait for everything launched; re-raises a failure of the background jobs."""
        pending, self._pending = self._pending, None
        try:
            if pending is not None:
                pending.result()
                if self.cuda:
                    torch.cuda.current_stream().wait_stream(self.stream)
        finally:
            for param in self._hooked:
                param.pending_rows = None
            self._hooked = []

    def close(self) -> None:
        try:
            self.finish()
        finally:
            self.worker.shutdown(wait=True)
