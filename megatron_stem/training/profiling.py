"""Where a step's time goes: a timer of its phases for every log line, and a window of
steps traced by torch's profiler (with a CUDA memory snapshot on a GPU), `profile`.

Phases are timed without adding a synchronization to the step. On CPU a phase is wall
time. On a GPU each phase records a pair of CUDA events on the current stream (a few
microseconds of launch, no wait) and the pairs are read when a line is logged, after one
`synchronize` of the last event: what the GPU was doing when the host is ahead is counted
in the phase whose kernels it runs, not in the phase the host is in. A phase that is host
work (the tables' CPU Adam) shows its host time there too, as the stream waits for its
next event. Each phase is also a `record_function` range, so a profiler trace shows it.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from megatron_stem.config import ProfileConfig
from megatron_stem.runtime.errors import ConfigError

# The step's phases, in the order a log line shows them.
PHASES = ("forward_backward", "backbone_step", "tables_stage", "tables_sync", "tables_step")
# The ones that are table work on the step's path (a host-table prefetch wait is added to
# them; an update overlapped with the next step shows only the part that is waited for).
TABLE_PHASES = ("tables_stage", "tables_sync", "tables_step")


class _WallSpan:
    def __init__(self):
        self.start = time.perf_counter()
        self.end = self.start

    def close(self) -> None:
        self.end = time.perf_counter()

    def ms(self) -> float:
        return (self.end - self.start) * 1e3


class _EventSpan:
    """Two CUDA events around a phase, read later (`event_type` is a seam for tests)."""

    def __init__(self, event_type):
        self.start, self.end = event_type(enable_timing=True), event_type(enable_timing=True)
        self.start.record()

    def close(self) -> None:
        self.end.record()

    def ms(self) -> float:
        return self.start.elapsed_time(self.end)


class PhaseTimer:
    """`with timer.phase(name):` around each phase of a step; `take()` at log time gives
    each phase's mean milliseconds per step since the last `take()`."""

    def __init__(self, cuda: Optional[bool] = None, event_type=None):
        cuda = torch.cuda.is_available() if cuda is None else cuda
        if cuda:
            event_type = event_type or torch.cuda.Event
            self._span: Callable = lambda: _EventSpan(event_type)
        else:
            self._span = _WallSpan
        self._spans: dict[str, list] = {}
        self._steps = 0

    @contextlib.contextmanager
    def phase(self, name: str):
        with torch.profiler.record_function(name):
            span = self._span()
            try:
                yield
            finally:
                span.close()
        self._spans.setdefault(name, []).append(span)

    def step_done(self) -> None:
        self._steps += 1

    def take(self) -> dict[str, float]:
        """{phase: ms per step} over the steps since the last call (then forgotten)."""
        spans, steps = self._spans, max(self._steps, 1)
        self._spans, self._steps = {}, 0
        last = [s[-1] for s in spans.values() if s]
        if last and isinstance(last[0], _EventSpan):
            for span in last:
                span.end.synchronize()  # the one wait, at log time
        return {name: sum(s.ms() for s in group) / steps for name, group in spans.items()}


def check_ranks(config: ProfileConfig, world_size: int) -> None:
    """Refuse, before training starts, a rank to trace that this world does not have."""
    if config.start_step:
        outside = [r for r in config.ranks if not 0 <= r < world_size]
        if outside:
            raise ConfigError(f"profile.ranks: rank {outside[0]} is not in this run's world "
                              f"of {world_size} ranks (0-{world_size - 1})")


class ProfilerWindow:
    """Traces steps `start_step .. start_step + steps - 1` on the chosen ranks: a torch
    profiler trace in TensorBoard's layout (`<dir>/rank<r>.<time>.pt.trace.json`, Chrome
    trace format: TensorBoard's profiler plugin, Perfetto or chrome://tracing read it),
    and on a GPU the CUDA allocator's history over the window as
    `<dir>/memory_rank<r>_steps<a>-<b>.pickle` (drag it into pytorch.org/memory_viz).
    The step before the window runs under the profiler untraced (its warm-up). `before(step)`
    before each step's work, `after(step)` after it. A run resumed past the window traces
    nothing; one resumed inside it traces the rest.

    `memory` (tests): the object with torch.cuda.memory's `_record_memory_history` and
    `_dump_snapshot`; default that module on a GPU, none on CPU."""

    def __init__(self, config: ProfileConfig, rank: int, save_dir: str, memory=None):
        self.config = config
        self.active = bool(config.start_step) and rank in config.ranks
        self.dir = Path(config.dir or Path(save_dir) / "profile")
        self.rank = rank
        if memory is None and config.memory_snapshot and torch.cuda.is_available():
            memory = torch.cuda.memory
        self.memory = memory
        self.profiler = None
        self._recording = False  # the CUDA allocator's history
        self.written: list[Path] = []  # what the window wrote, once it closed

    def before(self, step: int) -> None:
        if self.profiler is None:
            self._start(step)  # a warm-up step before the window, or the window's first
        if self.profiler is not None and step == self._first and self.memory is not None:
            self.memory._record_memory_history(max_entries=1_000_000)
            self._recording = True

    def _start(self, step: int) -> None:
        c = self.config
        warm_from = max(c.start_step - 1, 1)  # one untraced step first warms the profiler
        if not self.active or not warm_from <= step <= c.last_step:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        self._existing = set(self.dir.glob(f"rank{self.rank}.*"))  # an earlier job's
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        warmup = max(c.start_step - step, 0)
        self._first = self._last = step + warmup
        self.profiler = torch.profiler.profile(
            activities=activities, record_shapes=c.record_shapes, with_stack=c.with_stack,
            profile_memory=self.memory is not None,
            # Steps are marked (ProfilerStep#i) only under a schedule: 0 or 1 warm-up step,
            # then the window; the trace is written when its last step ends.
            schedule=torch.profiler.schedule(wait=0, warmup=warmup,
                                             active=c.last_step - self._first + 1, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(
                str(self.dir), worker_name=f"rank{self.rank}"))
        self.profiler.start()

    def after(self, step: int) -> None:
        if self.profiler is None:
            return
        self.profiler.step()
        self._last = step
        if step >= self.config.last_step:
            self.close()

    def close(self) -> None:
        """End the window (at its last step, or when the run stops inside it)."""
        if self.profiler is None:
            return
        self.profiler.stop()  # writes the trace if the window's last step did not
        self.profiler = None
        self.written = sorted(set(self.dir.glob(f"rank{self.rank}.*")) - self._existing)
        if self._recording:
            self._recording = False
            path = self.dir / f"memory_rank{self.rank}_steps{self._first}-{self._last}.pickle"
            self.memory._dump_snapshot(str(path))
            self.memory._record_memory_history(enabled=None)
            self.written.append(path)


class _Untimed:
    """A PhaseTimer that times nothing (callers that log no phases: benchmarks)."""

    @staticmethod
    def phase(name: str):
        return contextlib.nullcontext()


UNTIMED = _Untimed()
