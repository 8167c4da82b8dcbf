"""torchrun, started from a process that has already imported it.

`python -m torch.distributed.run` spends 3-5 s of one core importing torch before it starts
a rank, and the suite launches about seventy multi-process runs. Here each run's launcher
is a fork of one server process that imported torchrun's module once (multiprocessing's
forkserver, itself a fresh interpreter): the same `torch.distributed.run.main`, with the
same arguments, environment and working folder as the command line would have; its
elastic agent starts each rank as a new process (`python -u script ...`), as `torchrun`
does. Only the launcher's own import is saved.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import tempfile
import warnings
from pathlib import Path

_SERVER = multiprocessing.get_context("forkserver")
_SERVER.set_forkserver_preload(["torch.distributed.run", __name__])
_TERM_GRACE_S = 15  # a timed-out launcher's agent stops its ranks on SIGTERM


def _launch(args: list[str], env: dict, cwd: str, out: str, err: str) -> None:
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if env.get("PYTHONWARNINGS") == "ignore":  # read at start-up by a fresh interpreter
        warnings.simplefilter("ignore")
    for fd, path in ((1, out), (2, err)):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(file, fd)
        os.close(file)
    from torch.distributed.run import main

    main(args)  # an exception (a rank failed) is an exit code of 1, as from the command


def torchrun(args: list[str], env: dict, cwd: Path, timeout: float
             ) -> subprocess.CompletedProcess:
    """`torchrun *args` in `cwd` with `env`: its exit code, stdout and stderr; raises
    `subprocess.TimeoutExpired` after `timeout` seconds, its ranks stopped."""
    with tempfile.TemporaryDirectory() as tmp:
        out, err = f"{tmp}/stdout", f"{tmp}/stderr"
        launcher = _SERVER.Process(target=_launch, args=(args, env, str(cwd), out, err))
        launcher.start()
        launcher.join(timeout)
        timed_out = launcher.exitcode is None
        if timed_out:
            os.kill(launcher.pid, signal.SIGTERM)
            launcher.join(_TERM_GRACE_S)
            if launcher.exitcode is None:
                launcher.kill()
                launcher.join()
        stdout, stderr = Path(out).read_text(errors="replace"), Path(err).read_text(errors="replace")
    cmd = ["torchrun", *args]
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
    return subprocess.CompletedProcess(cmd, launcher.exitcode, stdout, stderr)
