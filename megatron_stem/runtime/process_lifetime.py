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


def exit_with_parent(who: str | None = None, launcher: str | None = None) -> None:
    """End this process (exit 1) within `POLL_S` of its parent's end, saying so in one
    line on stderr when `who` names it (e.g. "rank 1"). Idempotent.

    `launcher`, a word of the parent's command line: a process whose parent is already PID
    1, and PID 1 is not that launcher, lost its parent before it could watch it (a rank
    whose agent was killed in the rank's first moments, on a loaded node): it ends now. A
    parent that is PID 1 (a container whose first process is the launcher), or one that
    cannot be told apart, is left unwatched: its end ends the container."""
    parent = os.getppid()
    if parent in _watched:
        return
    if parent == 1:
        if launcher is not None and not _init_is(launcher):
            _gone(who, None)
        return
    _watched.add(parent)

    def watch():
        while os.getppid() == parent:
            time.sleep(POLL_S)
        _gone(who, parent)
    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _init_is(launcher: str) -> bool:
    """Whether PID 1's command line has `launcher` in it (True when it cannot be read)."""
    try:
        return launcher in Path("/proc/1/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return True


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
