"""Per-interval metrics: one readable console line and TensorBoard scalars (rank 0)."""

from __future__ import annotations

import sys
import time

import torch


def memory_gb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2 ** 30
    try:  # resident set size of this process
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2 ** 30
    except OSError:
        return 0.0


class Metrics:
    def __init__(self, log_dir: str, enabled: bool, purge_step: int):
        self.enabled = enabled
        self.writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops events a preempted run logged after its last checkpoint,
            # so a resumed run continues one clean curve in the same TensorBoard run.
            self.writer = SummaryWriter(log_dir, purge_step=purge_step or None)
        self._t0 = time.perf_counter()
        self._tokens = 0

    def count_tokens(self, tokens: int) -> None:
        self._tokens += tokens

    def throughput(self) -> float:
        """Tokens/s since the last call (the whole job's tokens, all ranks)."""
        now = time.perf_counter()
        rate = self._tokens / max(now - self._t0, 1e-9)
        self._t0, self._tokens = now, 0
        return rate

    def log(self, step: int, scalars: dict[str, float], line: str | None = None) -> None:
        if not self.enabled:
            return
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)
        if line:
            print(line, file=sys.stdout, flush=True)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
