"""`tables.overlap: next_step`: a step's table update runs while the next step computes.

The table update of step k (Adam over a rank's shard, then publishing the updated rows to
every rank) need not finish before step k+1 starts, only before step k+1 reads a row it
changes. So `TableOptimizer.step` splits each table's rows in three:

* the rows step k+1's first micro-batch looks up on any rank: updated and published
  first, table by table in forward order; a table's lookup in that forward waits for its
  own rows only (the table parameter's `pending_rows` callable, see `model/table.py`), so
  the tables of later layers are updated while earlier layers compute;
* the rows only its later micro-batches look up (none in a step of one micro-batch):
  next, in the same order, while the first micro-batch computes; their lookups wait for
  them;
* every other row: updated and published after them, while step k+1 runs; nothing reads
  them before step k+2, and `TableOptimizer` waits for them (`finish`) before it takes
  step k+1's gradients, saves, or evaluates.

Semantics are unchanged (the same arithmetic on every row, in another order of rows), so
the loss curve is the one without overlap.

**One thread issues every collective.** Each piece of the update (`Job`) is its
arithmetic, `compute` (Adam over its rows: the CPU kernel, which releases the GIL, or
kernels on the accelerator), run by a worker thread in order, and its publication,
`publish` (the rows copied to the accelerator, all-gathered over data parallel and written
into every rank's table), which only the main thread runs, in the jobs' order, at points
every rank's main thread reaches in the same order whatever its timing:

* a table's lookup publishes the jobs up to the one that puts its rows in place, then one
  job more (the next in line): the publications run one job ahead of the lookups;
* the trainer, before the step's last backward, publishes what the lookups have not
  (`publish_all`): it runs beside that backward (in a step of one micro-batch, most of
  the other rows);
* `finish` publishes what is left (a caller that is not the trainer's step).

So on every rank the collectives of every communicator, the update's and the main
thread's own (DeepSpeed's reduction, the step's scalars), come in one order, by
construction: NCCL asks for that, and with collectives issued from two threads ranks
interleave them as their threads happen to run (a hang when the GPU cannot run the two
communicators' kernels side by side). What a lookup waits for is the arithmetic of its
job (and of the one after it) on the worker, and, on the accelerator, its rows' own
all-gather; the publications themselves are queued on a side stream and overlap the
compute. Where they cannot: a lookup (or the last backward) whose job's arithmetic is not
done waits for it on the host, and the rows a lookup needs are all-gathered on its path
(docs/tables.md says what that costs).

What a second thread and, on a GPU, side streams take to be right:

* the update's collectives go over a clone of the data-parallel group, whose
  communicator is created at construction, on every rank (its own NCCL stream: the rows'
  all-gathers run beside the backbone's reductions instead of queueing with them);
* the current CUDA device is per thread: the worker takes the one the main thread had
  when the overlap was made (not `current_device()` in the worker, which is 0 there);
* tensors made on the compute stream and read by the jobs (gradients, row ids) are
  recorded on the worker's stream (`Job.inputs`), so the caching allocator does not give
  their memory to the compute stream while a job still reads them; the worker's stream
  and the publications' first wait for the compute stream; a publication waits for its
  job's event on the worker's stream, a lookup's compute stream for its publication's
  event, and `finish` makes the compute stream wait for both side streams;
* the buffers a job writes for its publication are written again only after the host has
  seen the last launch's publications done (the worker waits for their event first);
* a failed rank must exit: the worker is a daemon thread, and `close` waits for it at most
  `CLOSE_TIMEOUT_S`, then says which job is stuck and raises, so the rank exits non-zero
  and the launcher stops the job; `close` issues no collective (its peers may be gone).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_stem.tables import streams as side
from megatron_stem.tables.comm import Comm, Devices, host_tracking

CLOSE_TIMEOUT_S = 60.0
# The update's first parts, in order (module docstring): the next step's first forward
# waits for the fewest rows, and by its second micro-batch the rest it reads are in place.
STAGE_NAMES = ("rows the next step's first micro-batch reads",
               "rows its later micro-batches read")
READY_STAGES = len(STAGE_NAMES)


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


@dataclass
class Job:
    """One piece of the overlapped update: `compute()` on the worker thread, then
    `publish(comm)` on the main thread (module docstring); `inputs` the accelerator tensors
    `compute` reads that the compute stream made this step; `name` says what it is when it
    fails or hangs."""

    name: str
    compute: Callable[[], None]
    publish: Callable[[Comm], None] = lambda comm: None
    inputs: tuple[torch.Tensor, ...] = ()


@dataclass
class _Launched:
    """A job of the current launch: its arithmetic done (`computed`, with an event on the
    worker's stream after it), then its publication queued (an event on the publishing
    stream after it)."""

    job: Job
    computed: threading.Event = field(default_factory=threading.Event)
    computed_event: object = None
    published_event: object = None
    error: Optional[BaseException] = None


class _Lookups:
    """A table's `pending_rows` for the next step: a lookup needs the stages of rows it
    may read (`needs[k]`: the position of the table's stage-k job in the launch). The first
    lookup is the first micro-batch's forward; it, and a lookup of the same ids tensor
    (activation recompute replaying that forward), need stage 0 (the rows that micro-batch
    reads); every other lookup needs every stage. The first ids tensor is kept, so its
    memory cannot become another micro-batch's ids while the step runs (a later lookup
    with another tensor only ever waits longer)."""

    def __init__(self, overlap: "Overlap", needs: list[int]):
        self.overlap, self.needs = overlap, needs
        self._first: Optional[torch.Tensor] = None

    def __call__(self, token_ids: torch.Tensor) -> None:
        if self._first is None:
            self._first = token_ids
        same = token_ids.data_ptr() == self._first.data_ptr() and \
            token_ids.shape == self._first.shape and \
            token_ids.stride() == self._first.stride()
        needed = self.needs[:1] if same else self.needs
        self.overlap.publish_for(needed)


class Overlap:
    """Runs the arithmetic of table update jobs on a background thread, in order, one
    launch at a time, and their publications from the caller's (the main) thread.
    `streams`, `publishing`: the worker's and the publications' side streams
    (streams.py; made from the main thread's device)."""

    def __init__(self, dp_group, devices: Devices, streams=None, publishing=None):
        self.comm = Comm(clone_group(dp_group), devices, "the overlapped update's group")
        if self.comm.size > 1:  # its communicator now, on every rank
            self.comm.all_reduce(torch.zeros(1, device=devices.accelerator))
        self.streams = streams or side.side_streams(devices.accelerator)
        self.publishing = publishing or side.side_streams(devices.accelerator)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._launched: list[_Launched] = []
        self._published = 0  # how many of them the main thread has published
        self._last_published = None  # the publishing stream's event after the last launch
        self.running: Optional[str] = None  # the job the worker is in
        self._hooked: list[torch.nn.Parameter] = []
        self._worker = threading.Thread(target=self._work, name="stem-table-update",
                                        daemon=True)
        self._worker.start()

    def launch(self, stages: list[list[tuple[torch.nn.Parameter, Job]]],
               rest: list[Job]) -> None:
        """Run `stages` (each: per table, the job that puts in place the rows a part of
        the next step reads), stage by stage, then `rest`: their arithmetic in the
        background, their publications as the next step's lookups need them (`_Lookups`)
        and at `finish`."""
        self.finish()
        launched, needs = [], {}
        for stage in stages:
            for param, job in stage:
                needs.setdefault(param, []).append(len(launched))
                launched.append(_Launched(job))
        launched += [_Launched(job) for job in rest]
        for param, at in needs.items():
            param.pending_rows = _Lookups(self, at)
            self._hooked.append(param)
        inputs = [t for entry in launched for t in entry.job.inputs]
        self.streams.hand_over(inputs)
        self.publishing.hand_over([])  # after what the compute stream has queued
        self._launched, self._published = launched, 0
        self._queue.put((launched, self._last_published))

    def _work(self) -> None:
        self.streams.enter_worker()
        while True:
            launched, last_published = self._queue.get()
            entry = None
            try:
                # The buffers the last launch's publications read are written again here.
                self.publishing.synchronize(last_published)
                with host_tracking(), self.streams.running():
                    for entry in launched:
                        self.running = entry.job.name
                        entry.job.compute()
                        entry.computed_event = self.streams.mark()
                        entry.computed.set()
            except BaseException as e:  # raised on the main thread by `publish_for`
                for later in launched[launched.index(entry) if entry else 0:]:
                    later.error = e
                    later.computed.set()
            finally:
                self.running = None

    @property
    def running_jobs(self) -> bool:
        """Whether launched jobs are not all published."""
        return self._published < len(self._launched)

    def publish_for(self, needed: list[int]) -> None:
        """Publish, in order, the launched jobs up to the last of `needed` (positions in
        the launch), then the next one in line; the compute stream then waits for the
        publications of `needed` (on a CPU: they are done)."""
        through = min(max(max(needed, default=-1), self._published - 1) + 1,
                      len(self._launched) - 1)
        self._publish_through(through)
        for at in needed:
            self.publishing.wait(self._launched[at].published_event)

    def publish_all(self) -> None:
        """Publish every launched job not yet published (their collectives issued now, in
        order; the compute stream does not wait for them until `finish`)."""
        self._publish_through(len(self._launched) - 1)

    def _publish_through(self, last: int) -> None:
        while self._published <= last:
            entry = self._launched[self._published]
            entry.computed.wait()
            if entry.error is not None:
                raise RuntimeError(f"tables: the overlapped update failed in {entry.job.name}"
                                   f": {entry.error}") from entry.error
            self.publishing.follow(entry.computed_event)
            with host_tracking(), self.publishing.running():
                entry.job.publish(self.comm)
            entry.published_event = self.publishing.mark()
            self._published += 1

    def finish(self) -> None:
        """Publish everything launched (after its arithmetic); re-raises a failure of the
        background jobs. Afterwards the compute stream waits for all of it."""
        try:
            self._publish_through(len(self._launched) - 1)
            self._last_published = self.publishing.mark()
            self.streams.join()
            self.publishing.join()
        finally:
            self._forget()

    def _forget(self) -> None:
        """No launch in progress: the lookups wait for nothing."""
        self._launched, self._published = [], 0
        for param in self._hooked:
            param.pending_rows = None
        self._hooked = []

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Wait (at most `timeout` s a job) for the last jobs' arithmetic, and publish none
        of them: at the run's end nothing reads the tables any more (a save finishes the
        update first), and after a failure the other ranks may never reach the
        collectives. The daemon worker ends with the process."""
        try:
            for entry in self._launched[self._published:]:
                if not entry.computed.wait(timeout):
                    raise RuntimeError(
                        f"tables: the overlapped update is stuck in {self.running} after "
                        f"{timeout:.0f} s; this rank exits")
        finally:
            self._forget()
