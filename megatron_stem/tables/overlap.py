"""`tables.overlap: next_step`: a step's table update runs while the next step computes.

The table update of step k (Adam over a rank's shard, then publishing the updated rows to
every rank) need not finish before step k+1 starts, only before step k+1 reads a row it
changes. So `TableOptimizer.step` splits each table's rows in three:

* the rows step k+1's first micro-batch looks up on any rank: updated and published
  first, table by table in forward order; a table's lookup in that forward waits for its
  own rows only (the table parameter's `pending_rows` callable, see `model/table.py`), so
  the tables of later layers are updated while earlier layers compute;
* the rows only its later micro-batches look up: next, in the same order, while the first
  micro-batch computes; their lookups wait for them;
* every other row: updated and published after them, while step k+1 runs; nothing reads
  them before step k+2, and `TableOptimizer` waits for them (`finish`) before it takes
  step k+1's gradients, saves, or evaluates.

Semantics are unchanged (the same arithmetic on every row, in another order of rows), so
the loss curve is the one without overlap. What running on a second thread and, on a GPU,
a second stream takes to be right:

* collectives of two threads must not share a group: the jobs use a clone of the
  data-parallel group, whose communicator is created at construction, on every rank, from
  the main thread (NCCL creates communicators collectively: one created lazily by a worker
  while the main thread runs other collectives can deadlock);
* the order of collectives: on each communicator it is the same on every rank (one thread
  issues them, in an order that depends on no rank's data: the worker runs the same jobs
  in the same order everywhere). Between the two communicators it is not: the worker's
  all-gathers and the main thread's (DeepSpeed's reduction, the loss's mean, the stop
  signal) interleave as the threads happen to run. NCCL tolerates that only while the GPU
  runs the two streams' kernels side by side, so that a kernel waiting for its peers never
  blocks the other communicator's; with `CUDA_DEVICE_MAX_CONNECTIONS=1` (one hardware
  queue, which Megatron users often set) kernels of different streams can queue behind
  each other and two ranks that interleaved differently hang. So the overlap refuses to
  start on GPUs with that setting (`concurrency_problem`);
* the current CUDA device is per thread: the worker takes the one the main thread had
  when the overlap was made (not `current_device()` in the worker, which is 0 there);
* tensors made on the compute stream and read by the jobs (gradients, row ids) are
  recorded on the overlap's stream (`Job.inputs`), so the caching allocator does not give
  their memory to the compute stream while a job still reads them; the overlap's stream
  first waits for the compute stream; a table's rows are ready for the compute stream
  once an event recorded after their all-gather has passed, and `finish` makes the
  compute stream wait for everything;
* a failed rank must exit: the worker is a daemon thread, and `close` waits for it at most
  `CLOSE_TIMEOUT_S`, then says which job is stuck (typically in a collective whose peer
  died) and raises, so the rank exits non-zero and the launcher stops the job.
"""

from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_stem.runtime.errors import UserError
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
    """One piece of the overlapped update: `run(comm)` on the worker; `inputs` the
    accelerator tensors it reads that the compute stream made this step; `name` says what
    it is when it fails or hangs."""

    name: str
    run: Callable[[Comm], None]
    inputs: tuple[torch.Tensor, ...] = ()


class _Ready:
    """Set when a table's rows for part of the next step are in place."""

    def __init__(self, streams):
        self.streams = streams
        self.event = threading.Event()
        self.stream_event = None
        self.error: Optional[BaseException] = None

    def set(self) -> None:
        self.stream_event = self.streams.mark()
        self.event.set()

    def wait(self) -> None:
        self.event.wait()
        if self.error is not None:
            raise RuntimeError("the overlapped table update failed") from self.error
        if self.stream_event is not None:
            self.streams.wait(self.stream_event)


class _Lookups:
    """A table's `pending_rows` for the next step: a lookup waits for the stages of rows
    it may read. The first lookup is the first micro-batch's forward; it, and a lookup of
    the same ids tensor (activation recompute replaying that forward), wait for stage 0
    (the rows that micro-batch reads); every other lookup waits for all stages. The first
    ids tensor is kept, so its memory cannot become another micro-batch's ids while the
    step runs (a later lookup with another tensor only ever waits longer)."""

    def __init__(self, ready: list[_Ready]):
        self.ready = ready
        self._first: Optional[torch.Tensor] = None

    def __call__(self, token_ids: torch.Tensor) -> None:
        if self._first is None:
            self._first = token_ids
        same = token_ids.data_ptr() == self._first.data_ptr() and \
            token_ids.shape == self._first.shape and \
            token_ids.stride() == self._first.stride()
        self.ready[0 if same else -1].wait()


def concurrency_problem(environ, world_size: int) -> Optional[str]:
    """Why the overlap's collectives could hang on this device setup (module docstring:
    two threads' communicators need the GPU to run their streams side by side), or None."""
    if world_size > 1 and environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "").strip() == "1":
        return ("tables.overlap: next_step issues the tables' all-gathers from a second "
                "thread, on their own stream, which CUDA_DEVICE_MAX_CONNECTIONS=1 can queue "
                "behind the main thread's collectives (a hang when ranks interleave them "
                "differently): unset it, or set tables.overlap: none")
    return None


class Overlap:
    """Runs table update jobs on a background thread, in order, one step at a time.
    `streams`: a side stream's protocol (streams.py; made from the main thread's device)."""

    def __init__(self, dp_group, devices: Devices, streams=None):
        problem = concurrency_problem(os.environ, dist.get_world_size(dp_group)) \
            if torch.cuda.is_available() and dist.is_initialized() else None
        if problem is not None:
            raise UserError(problem)
        self.comm = Comm(clone_group(dp_group), devices, "the overlapped update's group")
        if self.comm.size > 1:  # its communicator now, from the main thread, on every rank
            self.comm.all_reduce(torch.zeros(1, device=devices.accelerator))
        self.streams = streams or side.side_streams(devices.accelerator)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Event()
        self._done.set()
        self._error: Optional[BaseException] = None
        self.running: Optional[str] = None  # the job the worker is in
        self._hooked: list[torch.nn.Parameter] = []
        self._worker = threading.Thread(target=self._work, name="stem-table-update",
                                        daemon=True)
        self._worker.start()

    def launch(self, stages: list[list[tuple[torch.nn.Parameter, Job]]],
               rest: list[Job]) -> None:
        """Run `stages` (each: per table, the job that puts in place the rows a part of
        the next step reads), stage by stage, then `rest`, in the background. A table's
        lookup waits until the stages of rows it may read are done (`_Lookups`)."""
        self.finish()
        queued, by_param = [], {}
        for stage in stages:
            for param, job in stage:
                ready = _Ready(self.streams)
                queued.append((job, ready))
                by_param.setdefault(param, []).append(ready)
        for param, ready in by_param.items():
            param.pending_rows = _Lookups(ready)
            self._hooked.append(param)
        jobs = [job for job, _ in queued] + rest
        self.streams.hand_over([t for job in jobs for t in job.inputs])
        self._done.clear()
        self._jobs.put((queued, rest))

    def _work(self) -> None:
        self.streams.enter_worker()
        while True:
            queued, rest = self._jobs.get()
            try:
                with host_tracking(), self.streams.running():
                    for job, ready in queued:
                        self._run(job)
                        ready.set()
                    for job in rest:
                        self._run(job)
            except BaseException as e:  # handed to the main thread
                self._error = e
                for _, ready in queued:
                    ready.error = ready.error or e
                    ready.event.set()
            finally:
                self.running = None
                self._done.set()

    @property
    def running_jobs(self) -> bool:
        """Whether launched jobs have not all finished."""
        return not self._done.is_set()

    def _run(self, job: Job) -> None:
        self.running = job.name
        job.run(self.comm)

    def finish(self, timeout: Optional[float] = None) -> None:
        """Wait for everything launched; re-raises a failure of the background jobs.
        `timeout`: at most that many seconds, then a RuntimeError naming the stuck job."""
        try:
            if not self._done.wait(timeout):
                raise RuntimeError(
                    f"tables: the overlapped update is stuck in {self.running} after "
                    f"{timeout:.0f} s (a collective whose peer rank has failed?); this "
                    "rank exits")
            error, self._error = self._error, None
            if error is not None:
                raise RuntimeError(f"tables: the overlapped update failed: {error}") \
                    from error
            self.streams.join()
        finally:
            for param in self._hooked:
                param.pending_rows = None
            self._hooked = []

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Wait (at most `timeout` s) for the last jobs; the daemon worker ends with the
        process."""
        self.finish(timeout)
