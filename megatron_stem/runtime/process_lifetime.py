"""No process of ours outlives the job it belongs to.

A rank whose torchrun agent was killed would train on unsupervised (nothing would stop it
on a failure elsewhere, nor reap it), and a preprocessing worker whose main process died
would wait for chunks forever. `exit_with_parent` ends such a process once its parent is
gone (polled: a parent-death signal is tied to the thread that forked, and torchrun may
fork from another). A finished rank can also be kept alive by a thread a library left
running (interpreter shutdown joins every non-daemon thread): `exit_soon` ends it anyway.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

POLL_S = 1.0
_watched: set[int] = set()  # the parents already watched, once per process

# What a torchrun launcher runs: the `torchrun` command (slurm/torchrun.py, its wrapper),
# or the module behind it.
LAUNCHER_PROGRAMS = frozenset({"torchrun", "torchrun.py"})
LAUNCHER_MODULES = frozenset({"torch.distributed.run", "torch.distributed.launch"})
_PYTHON_LONG_VALUE_OPTIONS = frozenset({"--check-hash-based-pycs"})


def exit_with_parent(who: str | None = None, launched: bool = False) -> None:
    """End this process (exit 1) within `POLL_S` of its parent's end, saying so in one
    line on stderr when `who` names it (e.g. "rank 1"). Idempotent.

    `launched`: the parent should be a torchrun launcher (`is_launcher`). A parent that is
    not one means the launcher died before this process could watch it (a rank whose
    agent was killed in the rank's first moments, on a loaded node) and the process was
    reparented: to PID 1, or to a subreaper (`tini -s`, `systemd --user`, a container's
    init) that outlives the job: it ends now. A parent whose command line cannot be read is
    watched. Otherwise a parent that is PID 1 is left unwatched: its end ends the
    container."""
    parent = os.getppid()
    if parent in _watched:
        return
    if launched:
        if is_launcher(parent) is False:
            _gone(who, None)
    elif parent == 1:
        return
    _watched.add(parent)

    def watch():
        while os.getppid() == parent:
            time.sleep(POLL_S)
        _gone(who, parent)
    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def is_launcher(pid: int) -> bool | None:
    """Whether process `pid` is a torchrun launcher (`launcher_command`); None when its
    command line cannot be read."""
    proc = Path("/proc") / str(pid)
    try:
        argv = proc.joinpath("cmdline").read_bytes().decode(errors="replace").split("\0")
        name = proc.joinpath("comm").read_text().strip()
    except OSError:
        return None
    return launcher_command([a for a in argv if a], name)


def launcher_command(argv: list[str], name: str = "") -> bool:
    """Whether a process of command line `argv` and process name `name` (what `ps` shows:
    a script run by its `#!` line is named after the script) is a torchrun launcher: by the
    program it runs, `torchrun` (`LAUNCHER_PROGRAMS`), or by the module a Python runs
    (`python -m torch.distributed.run`), never by a word somewhere in a path
    (`/opt/torch/bin/python3 train.py` is no launcher)."""
    if name in LAUNCHER_PROGRAMS:
        return True
    if not argv:
        return False
    program = os.path.basename(argv[0])
    if program in LAUNCHER_PROGRAMS:
        return True
    if not program.startswith("python"):
        return False
    args = iter(argv[1:])
    for arg in args:  # the interpreter's options, then what it runs
        if not arg.startswith("-"):  # a script
            return os.path.basename(arg) in LAUNCHER_PROGRAMS
        if arg.startswith("--"):
            if arg in _PYTHON_LONG_VALUE_OPTIONS:
                next(args, None)
            continue
        for at, letter in enumerate(arg[1:], 2):  # `-u`, `-um MODULE`, `-Wignore`, ...
            rest = arg[at:]
            if letter == "m":
                return (rest or next(args, "")) in LAUNCHER_MODULES
            if letter == "c":
                return False  # a command string runs no launcher's file
            if letter in "WX":  # an option's value: the rest, or the next argument
                if not rest:
                    next(args, None)
                break
    return False


def _gone(who: str | None, parent: int | None) -> None:
    if who is not None:
        which = f" (pid {parent})" if parent is not None else ""
        print(f"{who}: its launcher{which} is gone; exiting", file=sys.stderr, flush=True)
    os._exit(1)


def exit_soon(code: int, grace_s: float = 60.0) -> None:
    """Exit with `code` as usual (atexit handlers, buffered files), or, if that has not
    ended the process within `grace_s` (a thread left running), at once."""
    def force():
        time.sleep(grace_s)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    threading.Thread(target=force, name="exit-soon", daemon=True).start()
    sys.exit(code)
