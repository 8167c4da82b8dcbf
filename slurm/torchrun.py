"""torchrun as slurm/launch.sh runs it on each node: same arguments, quieter stop.

torchrun forwards a stop signal to its ranks (`--signals-to-handle`), waits for them to
save and exit (`--shutdown-timeout`), then dies with a SignalException traceback and exit
code 1, which `srun --kill-on-bad-exit` would take for a crash. A stop is routine under
SLURM, so on SignalException this wrapper instead

- ignores further stop signals and waits for any rank still running (repeated signals,
  e.g. a second SIGUSR1 and then SLURM's SIGTERM, cut torchrun's own wait short, and SLURM
  kills what is left of a step when its task exits: ranks still writing a checkpoint
  would die);
- on the node that hosts the rendezvous store (`is_host=1`), stays a few seconds more:
  the other nodes' torchruns still talk to that store while their ranks exit, and log a
  TCPStore error with a C++ stack when it is gone (the exception's traceback keeps
  torchrun's store alive meanwhile);
- prints one line; on SIGUSR1 (stop to be requeued) touches `$STEM_STOP_MARKER.<host>` so
  the batch script knows the ranks stopped, and exits 0; on other signals exits 128+signal.
"""

import os
import signal
import socket
import sys
import time
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
STORE_LINGER_S = 5


def _wait_for_children(timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.2)


def run() -> int:
    try:
        main()
    except SignalException as e:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        _wait_for_children(float(os.environ.get("STEM_SHUTDOWN_TIMEOUT", "600")))
        if any(a.startswith("--rdzv-conf") and "is_host=1" in a for a in sys.argv[1:]):
            time.sleep(STORE_LINGER_S)
        host = socket.gethostname()
        print(f"stem: {host}: ranks stopped by {e.sigval.name}", file=sys.stderr, flush=True)
        if e.sigval == signal.SIGUSR1:
            marker = os.environ.get("STEM_STOP_MARKER")
            if marker:
                Path(f"{marker}.{host}").touch()
            return 0
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(run())
