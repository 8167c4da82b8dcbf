"""torchrun as slurm/launch.sh runs it on each node: same arguments, quieter stop.

What a stop signal does is the trainer's alone (megatron_stem/training/stop.py: finish
the step, save a checkpoint, exit). torchrun only forwards the signal to its ranks
(`--signals-to-handle`) and waits for them (`--shutdown-timeout`), then dies with a
SignalException traceback and exit code 1, which `srun --kill-on-bad-exit` would take for
a crash. A stop is routine under SLURM, so on SignalException this wrapper instead

- ignores further stop signals and waits for any rank still running (repeated signals,
  e.g. a second SIGUSR1 and then SLURM's SIGTERM, cut torchrun's own wait short, and SLURM
  kills what is left of a step when its task exits: ranks still writing a checkpoint
  would die);
- on the node that hosts the rendezvous store (`is_host=1`), stays a few seconds more:
  the other nodes' torchruns still talk to that store while their ranks exit, and log a
  TCPStore error with a C++ stack when it is gone (the exception's traceback keeps
  torchrun's store alive meanwhile);
- prints one line and passes the ranks' answer on, which torchrun does not (it drops their
  exit codes after a signal): exit 0 when they saved and stopped to be requeued (the
  trainer then leaves `$STEM_STOP_MARKER.<host>`, which the batch script also reads),
  else 128+signal, as for a process the signal ended.

After a run that ended normally, the node that hosts the store leaves last. Every agent
waits for the others at torchrun's exit barrier, then closes the rendezvous, both through
the store; the host's agent passes the barrier as soon as the last agent arrives and would
exit (taking the store with it) while that agent still waits for its answer, which then
logs "Error waiting on exit barrier" and a failed rendezvous shutdown on a job that
succeeded. So each other node's wrapper, once its torchrun is done with the store, counts
itself done there, and the host's waits for that count (`AGENTS_DONE_WAIT_S` at most).

A rank that ends with a user's mistake (exit code 2, `megatron_stem/runtime/errors.py`)
has said it in one line (rank 0), or left it in torchrun's error file (another rank, printed
here when rank 0 did not fail with it): the wrapper exits 2 after it, without torchrun's
report and traceback of the failure.

It also names a rank that fails the moment torchrun sees it (`stem: <host>: rank N (local
rank i) failed: ...`). torchrun itself names it only after stopping the node's other ranks,
which can take up to 30 s (they take its SIGTERM for a stop and try to finish their step);
meanwhile the ranks on other nodes fail in their broken collectives, their torchrun
reports first, and srun kills this one before it says anything: the log would name only
victims.
"""

import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

import torch.distributed.elastic.rendezvous.registry as rendezvous_registry
from torch.distributed.elastic.multiprocessing.api import SignalException, SubprocessContext
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args
from torch.distributed.run import run as torchrun

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
STORE_LINGER_S = 5
USER_ERROR = 2  # a rank's exit code for a user's mistake (megatron_stem/runtime/errors.py)
AGENTS_DONE_KEY = "megatron_stem/agents_done"
AGENTS_DONE_WAIT_S = 60  # only a node whose agent died keeps the host waiting that long


def _wait_for_children(timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.2)


def _say_failures_at_once(context=SubprocessContext) -> None:
    """Print the failed ranks when torchrun starts stopping the others (torch 2.13: its
    process context's `_close`, which `_poll` calls on the first failure it sees, every
    `--monitor-interval` seconds)."""
    close = context._close
    host = socket.gethostname()

    def say_and_close(self, *args, **kwargs):
        failures = getattr(self, "_failures", None)
        if failures and not _a_user_error(failures) and not getattr(self, "_stem_said", False):
            self._stem_said = True
            for local_rank, failure in sorted(self._failures.items()):
                how = (f"Signal {-failure.exitcode} ({failure.signal_name()})"
                       if failure.exitcode < 0 else f"exit code {failure.exitcode}")
                rank = self.envs.get(local_rank, {}).get("RANK", "?")
                print(f"stem: {host}: rank {rank} (local rank {local_rank}) failed: {how}; "
                      "stopping the node's other ranks", file=sys.stderr, flush=True)
        return close(self, *args, **kwargs)

    context._close = say_and_close


def _keep_rendezvous(handlers: list, registry=rendezvous_registry) -> None:
    """Keep the rendezvous handler torchrun makes (and with it the store) in `handlers`,
    for `_leave_in_order` after torchrun is done with it."""
    make = registry.get_rendezvous_handler

    def make_and_keep(params):
        handler = make(params)
        handlers.append(handler)
        return handler

    registry.get_rendezvous_handler = make_and_keep


def _leave_in_order(handlers: list, hosts_store: bool, wait: float = AGENTS_DONE_WAIT_S
                    ) -> None:
    """The other nodes' agents count themselves done in the store; the host's agent waits
    for all of them (at most `wait` seconds) before its store goes."""
    store = getattr(handlers[0], "_store", None) if handlers else None
    nodes = getattr(getattr(handlers[0], "_settings", None), "min_nodes", 1) if handlers else 1
    if store is None:  # another torch's handler: give the others time, blind
        if hosts_store:
            time.sleep(STORE_LINGER_S)
        return
    if nodes < 2:
        return
    try:
        if not hosts_store:
            store.add(AGENTS_DONE_KEY, 1)
            return
        deadline = time.monotonic() + wait
        while store.add(AGENTS_DONE_KEY, 0) < nodes - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    except RuntimeError:  # the store is gone already (its host ended): nothing to order
        pass


def _hosts_store(argv: list[str]) -> bool:
    return any(a.startswith("--rdzv-conf") and "is_host=1" in a for a in argv)


def _no_report_of_user_errors() -> None:
    """torchrun's agent logs the first failed rank as an error: not one that said its own
    mistake (the rank's line is the report)."""
    def keep(record: logging.LogRecord) -> bool:
        return not (str(record.msg).startswith("failed (exitcode: %s)") and record.args
                    and record.args[0] == USER_ERROR)

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(keep)


def _a_user_error(failures: dict) -> bool:
    """Whether the first rank to fail ended with a user's mistake, and the others with it
    or by the signal torchrun then stops them with."""
    first = min(failures.values(), key=lambda f: f.timestamp)
    return first.exitcode == USER_ERROR and all(
        f.exitcode == USER_ERROR or f.exitcode < 0 for f in failures.values())


def _said_user_error(error: ChildFailedError) -> bool:
    """Whether the ranks failed with a user's mistake (`_a_user_error`); if so, its line is
    out: rank 0 said it, or the first such rank's, from its error file, is printed here."""
    if not _a_user_error(error.failures):
        return False
    said = {rank: f for rank, f in error.failures.items() if f.exitcode == USER_ERROR}
    if 0 not in said:
        first, failure = min(said.items())
        if Path(failure.error_file).is_file():
            print(f"error: rank {first}: {failure.message}", file=sys.stderr, flush=True)
    return True


def run() -> int:
    _say_failures_at_once()
    _no_report_of_user_errors()
    handlers: list = []
    _keep_rendezvous(handlers)
    try:
        torchrun(parse_args(sys.argv[1:]))  # not its `main`, whose @record logs a failure
    except ChildFailedError as e:
        if _said_user_error(e):
            return USER_ERROR
        raise
    except SignalException as e:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        _wait_for_children(float(os.environ.get("STEM_SHUTDOWN_TIMEOUT", "600")))
        if _hosts_store(sys.argv[1:]):
            time.sleep(STORE_LINGER_S)
        host = socket.gethostname()
        print(f"stem: {host}: ranks stopped by {e.sigval.name}", file=sys.stderr, flush=True)
        marker = os.environ.get("STEM_STOP_MARKER")
        return 0 if marker and Path(f"{marker}.{host}").is_file() else 128 + int(e.sigval)
    _leave_in_order(handlers, _hosts_store(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(run())
