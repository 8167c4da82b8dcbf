"""The one handler of a stop signal: save a complete checkpoint, then exit.

SIGUSR1 (SLURM's `--signal=B:USR1@300` before the time limit, or a manual stop) and
SIGTERM (scancel, preemption) both end the run after the step in progress, with a
checkpoint of that step. SIGUSR1 also means "come back": the trainer exits with
`EXIT_REQUEUE` and, under a launcher that asks for it (`STEM_STOP_MARKER`, set by
slurm/launch.sh), leaves the file `$STEM_STOP_MARKER.<host>` from each node, since torchrun
does not pass its ranks' exit codes on after it forwarded them a signal. Everything above
the trainer (launch.sh, slurm/torchrun.py) only forwards the signal and carries this
answer back: docs/slurm.md.
"""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_stem.parallel import device

EXIT_REQUEUE = 99  # stopped by a signal after saving: the job should be requeued
_STOP, _REQUEUE = 1.0, 2.0  # what a rank was asked for; the ranks agree on the most


class StopSignal:
    """A flag set by SIGUSR1/SIGTERM; ranks agree on it once per step. Install it before
    anything slow: a stop signal during start-up must set the flag, not kill the rank by
    default action (possibly while it holds torch's JIT-extension build lock, which would
    then hang every later run sharing that cache)."""

    def __init__(self):
        self._asked = 0.0
        self.requeue = False  # set by `requested` when the stop was a SIGUSR1
        signal.signal(signal.SIGUSR1, self._set)
        signal.signal(signal.SIGTERM, self._set)

    def _set(self, signum, frame):
        self._asked = max(self._asked, _REQUEUE if signum == signal.SIGUSR1 else _STOP)

    def requested(self) -> bool:
        """Whether any rank got a stop signal (a collective: every rank calls it)."""
        asked = torch.tensor([self._asked], device=device())
        dist.all_reduce(asked, op=dist.ReduceOp.MAX)
        self.requeue = asked.item() == _REQUEUE
        return asked.item() > 0

    def report(self) -> None:
        """Tell the launcher that this node's ranks saved and stopped to be requeued
        (call after the checkpoint is committed; one file per node)."""
        marker = os.environ.get("STEM_STOP_MARKER")
        if self.requeue and marker and os.environ.get("LOCAL_RANK", "0") == "0":
            Path(f"{marker}.{socket.gethostname()}").touch()
