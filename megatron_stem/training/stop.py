"""The one handler of a stop signal: save a complete checkpoint, then exit.

SIGUSR1 (SLURM's `--signal=B:USR1@300` before the time limit, or a manual stop) and
SIGTERM (scancel, preemption) both end the run after the step in progress, with a
checkpoint of that step. SIGUSR1 also means "come back": the trainer exits with
`EXIT_REQUEUE` and, under a launcher that asks for it (`STEM_STOP_MARKER`, set by
slurm/launch.sh), leaves the file `$STEM_STOP_MARKER.<host>` from each node, since torchrun
does not pass its ranks' exit codes on after it forwarded them a signal. Everything above
the trainer (launch.sh, slurm/torchrun.py) only forwards the signal and carries this
answer back: docs/slurm.md.

A signal can come at any moment, also while a rank is still importing torch: the trainer
(`python -m megatron_stem.train`) calls `catch_stop_signals` before its first slow import,
so this module imports nothing slow at its top, and the flag it sets is the process's,
which the run's `StopSignal` reads once it exists.
"""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

from megatron_stem.runtime import process_lifetime

EXIT_REQUEUE = 99  # stopped by a signal after saving: the job should be requeued
_STOP, _REQUEUE = 1.0, 2.0  # what a rank was asked for; the ranks agree on the most
_asked = 0.0  # the most this process was asked for, by any signal caught so far


def _set(signum, frame):
    global _asked
    _asked = max(_asked, _REQUEUE if signum == signal.SIGUSR1 else _STOP)


def catch_stop_signals() -> None:
    """From now on SIGUSR1 and SIGTERM set this process's stop flag instead of killing it
    by default action (possibly while it holds torch's JIT-extension build lock, which
    would then hang every later run sharing that cache)."""
    signal.signal(signal.SIGUSR1, _set)
    signal.signal(signal.SIGTERM, _set)


def end_with_launcher() -> None:
    """In a rank torchrun started: end it when the launcher dies (`process_lifetime`), or
    now when it already has. A run started from a shell is left alone: under nohup it
    outlives its shell, as asked."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        process_lifetime.exit_with_parent(f"rank {os.environ.get('RANK', '?')}", launched=True)


class StopSignal:
    """The stop flag (`catch_stop_signals`, also of the signals caught before it was made);
    ranks agree on it once per step (`share`, read with the step's other values: a signal
    that comes after that point stops the run a step later). A rank also ends with its
    launcher (`end_with_launcher`)."""

    def __init__(self):
        self.requeue = False  # set by `requested` when the stop was a SIGUSR1
        self._agreed = None  # this step's agreed flag, a HostValue
        catch_stop_signals()
        end_with_launcher()

    def share(self, read) -> None:
        """Every rank's flag, agreed (a collective: every rank calls it), into the step's
        host read `read` (runtime/host_read.py)."""
        import torch  # not at the top: see the module's docstring
        import torch.distributed as dist

        from megatron_stem.runtime.parallel import device

        asked = torch.full((1,), _asked, device=device())  # a fill: no copy, no sync
        dist.all_reduce(asked, op=dist.ReduceOp.MAX)
        self._agreed = read.add(asked)

    def requested(self) -> bool:
        """Whether any rank got a stop signal by the last `share` (without one: now, a
        collective and a host read of its own)."""
        if self._agreed is None:
            from megatron_stem.runtime.host_read import HostRead

            self.share(HostRead())
        asked, self._agreed = self._agreed.get(), None
        self.requeue = asked == _REQUEUE
        return asked > 0

    def report(self) -> None:
        """Tell the launcher that this node's ranks saved and stopped to be requeued
        (call after the checkpoint is committed; one file per node)."""
        marker = os.environ.get("STEM_STOP_MARKER")
        if self.requeue and marker and os.environ.get("LOCAL_RANK", "0") == "0":
            Path(f"{marker}.{socket.gethostname()}").touch()
