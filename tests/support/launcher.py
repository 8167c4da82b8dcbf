"""torchrun, with its ranks forked from a process that has already imported the libraries.

A rank started as `python -u script` spends ~7 s of one core importing torch, megatron-core,
DeepSpeed and our trainer (and TorchDynamo, which torch.optim imports at the first step)
before it runs a line of the test, and the suite starts ~150 ranks on two cores. Here each
run's launcher is a fork of one server process that imported all of that once
(multiprocessing's forkserver, itself a fresh interpreter), and it runs torchrun's own
argument parsing and elastic launch with the same arguments, environment and working
folder as the command line would, plus torchrun's `--run-path --start-method=fork`: its
elastic agent forks each rank, which runs the script with `runpy.run_path` as `__main__`
(`_rank`, not torchrun's own rank function: see `_launch`). The rendezvous, the ranks'
environment, the gloo groups, the agent's monitoring and its stopping of the ranks are
torchrun's, unchanged. A forked rank is made to start as an exec'd one would (`_launch`,
`_rank`): unbuffered output (`-u`), one intra-op thread (OMP_NUM_THREADS, which
a fresh interpreter reads at start-up), the script's folder first on `sys.path`, and the
default actions of the signals the agent handles for itself. The command-line tests
(quickstart, SLURM, the GPU script) still start the real `torchrun` with exec'd ranks.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

# What every worker imports first; TorchDynamo: torch.optim imports it at the first step.
RANK_MODULES = ["megatron_stem.train", "torch._dynamo"]
_SERVER = multiprocessing.get_context("forkserver")
_SERVER.set_forkserver_preload(["torch.distributed.run", __name__, *RANK_MODULES])
_TERM_GRACE_S = 15  # a timed-out launcher's agent stops its ranks on SIGTERM
# torchrun's agent handles these itself (TORCHELASTIC_SIGNALS_TO_HANDLE's default): a rank
# forked from it would inherit its handlers, where an exec'd rank has the defaults.
_AGENT_SIGNALS = {signal.SIGTERM: signal.SIG_DFL, signal.SIGINT: signal.default_int_handler,
                  signal.SIGHUP: signal.SIG_DFL, signal.SIGQUIT: signal.SIG_DFL}


def _unbuffered(fd: int, errors: str) -> io.TextIOWrapper:
    """A standard stream as `python -u` makes it: write-through text on an unbuffered fd."""
    return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8",
                            errors=errors, write_through=True)


def _rank(script: str, *argv: str) -> None:
    """A rank, forked by the agent, as `python -u script *argv` would start it (the module
    docstring); its exit code is the script's."""
    for sig, action in _AGENT_SIGNALS.items():
        signal.signal(sig, action)
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:  # `sys.exit(main())` of a main that returns None: success
        if e.code not in (None, 0):
            raise


def _named_torchrun() -> None:
    """Name this process `torchrun`, as the command's process is named (what `ps` shows;
    its command line stays the forkserver's): its ranks' orphan guard recognizes their
    launcher by it (megatron_stem/runtime/process_lifetime.py)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(15, b"torchrun", 0, 0, 0)  # PR_SET_NAME


def _launch(args: list[str], env: dict, cwd: str, out: str, err: str) -> None:
    _named_torchrun()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if env.get("PYTHONWARNINGS") == "ignore":  # read at start-up by a fresh interpreter
        warnings.simplefilter("ignore")
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, path in ((1, out), (2, err)):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(file, fd)
        os.close(file)
    sys.stdout, sys.stderr = _unbuffered(1, "strict"), _unbuffered(2, "backslashreplace")
    import torch
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", torch.get_num_threads())))
    # torchrun's `main` with `--run-path`, whose rank function (`runpy.run_path`) takes
    # the `sys.exit(None)` of a finished script for a rank that never returns: ours.
    config, _, script_args = config_from_args(parse_args(
        ["--run-path", "--start-method=fork", *args]))
    # an exception (a rank failed) is an exit code of 1, as from the command
    elastic_launch(config, entrypoint=_rank)(*script_args)


def torchrun(args: list[str], env: dict, cwd: Path, timeout: float
             ) -> subprocess.CompletedProcess:
    """`torchrun *args` in `cwd` with `env`: its exit code, stdout and stderr; raises
    `subprocess.TimeoutExpired` after `timeout` seconds, its ranks stopped. The script (the
    first argument ending in .py) must be an absolute path (`--run-path`)."""
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
