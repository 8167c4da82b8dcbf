"""`tables.overlap: next_step`: a step's table update runs while the next step computes.

The table update of step k (Adam over a rank's shard, then publishing the updated rows to
every rank) need not finish before step k+1 starts, only before step k+1 reads a row it
changes. So `TableOptimizer.step` splits each table's rows in two:

* the rows step k+1 looks up on any rank: updated and published first, table by table in
  forward order; a table's lookup in step k+1's forward waits for its own rows only (the
  table parameter's `pending_rows` callable, see `model/table.py`), so the tables of
  later layers are updated while earlier layers compute;
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

import contextlib
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_stem.training.tables.comm import Comm, Devices, host_tracking

CLOSE_TIMEOUT_S = 60.0


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


class CudaStreams:
    """The overlap's CUDA stream, on the device the main thread had when it was made."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def enter_worker(self) -> None:
        torch.cuda.set_device(self.device)  # the worker's current device: the main thread's

    def hand_over(self, tensors) -> None:
        """Before the worker starts on `tensors`, made on the compute stream: its stream
        waits for that stream's work, and their memory is not reused while it reads."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for t in tensors:
            if t.is_cuda:
                t.record_stream(self.stream)

    def running(self):
        return torch.cuda.stream(self.stream)

    def mark(self):
        """An event after what the worker has queued so far."""
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait(self, event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def join(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.stream)


class NoStreams:
    """A CPU run: the worker's work is done when its jobs return."""

    def enter_worker(self) -> None:
        pass

    def hand_over(self, tensors) -> None:
        pass

    def running(self):
        return contextlib.nullcontext()

    def mark(self):
        return None

    def wait(self, event) -> None:
        pass

    def join(self) -> None:
        pass


class _Ready:
    """Set when a table's rows for the next forward are in place."""

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


class Overlap:
    """Runs table update jobs on a background thread, in order, one step at a time.
    `streams`: CUDA's (made from the main thread's device) or none (CPU)."""

    def __init__(self, dp_group, devices: Devices, streams=None):
        self.comm = Comm(clone_group(dp_group), devices, "the overlapped update's group")
        if self.comm.size > 1:  # its communicator now, from the main thread, on every rank
            self.comm.all_reduce(torch.zeros(1, device=devices.accelerator))
        self.streams = streams or (CudaStreams(devices.accelerator)
                                   if devices.accelerator.type == "cuda" else NoStreams())
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Event()
        self._done.set()
        self._error: Optional[BaseException] = None
        self.running: Optional[str] = None  # the job the worker is in
        self._hooked: list[torch.nn.Parameter] = []
        self._worker = threading.Thread(target=self._work, name="stem-table-update",
                                        daemon=True)
        self._worker.start()

    def launch(self, first: list[tuple[torch.nn.Parameter, Job]], rest: list[Job]) -> None:
        """Run `first` (per table: the job that puts the rows the next forward needs in
        place), then `rest`, in the background. Until a table's first job is done, its
        lookups wait (`param.pending_rows`)."""
        self.finish()
        ready = [_Ready(self.streams) for _ in first]
        for (param, _), r in zip(first, ready):
            param.pending_rows = r.wait
            self._hooked.append(param)
        jobs = [j for _, j in first]
        self.streams.hand_over([t for job in jobs + rest for t in job.inputs])
        self._done.clear()
        self._jobs.put((jobs, ready, rest))

    def _work(self) -> None:
        self.streams.enter_worker()
        while True:
            first, ready, rest = self._jobs.get()
            try:
                with host_tracking(), self.streams.running():
                    for job, r in zip(first, ready):
                        self._run(job)
                        r.set()
                    for job in rest:
                        self._run(job)
            except BaseException as e:  # handed to the main thread
                self._error = e
                for r in ready:
                    r.error = r.error or e
                    r.event.set()
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
