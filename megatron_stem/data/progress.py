"""A one-line progress report: docs/s, tokens/s, MB/s and, when the size is known, ETA.

On a terminal the line is redrawn in place twice a second; in a log file (SLURM) a line is
written every `interval` seconds. Rates are averages over the run's own work, so resumed
work neither inflates them nor shortens the ETA.
"""

from __future__ import annotations

import time
from typing import Optional, TextIO


def _si(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    def __init__(self, stream: Optional[TextIO], total_disk_bytes: Optional[int] = None,
                 interval: float = 10.0):
        self.stream = stream
        self.tty = bool(stream is not None and stream.isatty())
        self.interval = 0.5 if self.tty else interval
        self.total = total_disk_bytes
        self.start = self._last = time.monotonic()
        self.docs = self.tokens = self.input_bytes = self.disk_bytes = 0
        self.skipped_disk = 0  # done by an earlier run

    def add(self, docs: int = 0, tokens: int = 0, input_bytes: int = 0, disk_bytes: int = 0):
        self.docs += docs
        self.tokens += tokens
        self.input_bytes += input_bytes
        self.disk_bytes += disk_bytes

    def resumed(self, disk_bytes: int) -> None:
        self.skipped_disk += disk_bytes

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        parts = [f"{self.docs:,} docs", f"{_si(self.docs / elapsed)} docs/s",
                 f"{_si(self.tokens / elapsed)} tok/s",
                 f"{self.input_bytes / elapsed / 1e6:.1f} MB/s", _duration(elapsed)]
        if self.total:
            done = self.disk_bytes + self.skipped_disk
            parts.insert(0, f"{100 * min(done / self.total, 1):5.1f}%")
            # Early rates mislead (start-up, a first tiny file): wait a little for an ETA.
            if self.disk_bytes and (elapsed >= 3 or self.disk_bytes >= self.total / 20):
                left = max(self.total - done, 0) * elapsed / self.disk_bytes
                parts.append(f"ETA {_duration(left)}")
        return " | ".join(parts)

    def tick(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.stream is None or (not force and now - self._last < self.interval):
            return
        self._last = now
        if self.tty:
            self.stream.write("\r" + self.line() + "\x1b[K")
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        """A line of its own (a warning) without garbling the progress line."""
        if self.stream is None:
            return
        self.stream.write(("\r\x1b[K" if self.tty else "") + text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.stream is not None:
            self.tick(force=True)
            if self.tty:
                self.stream.write("\n")
                self.stream.flush()
