"""Advisory file locks (`flock`) between processes that share a folder, and the one answer
for a filesystem that has none.

Some shared filesystems refuse `flock` (Lustre mounted `noflock`: ENOLCK or EOPNOTSUPP);
a lock there cannot keep two builders apart, so taking it is a mistake the user fixes
where the folder lives, said in one line naming the lock. Others grant it on each node
alone (Lustre `localflock`, NFS without a lock manager): a lock then keeps apart the
processes of one node only, and what it guards must stay correct without it (the JIT ops'
builds are per node; the data cache's files are whole when they appear, data/sample_cache.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Callable

from megatron_stem.runtime.errors import UserError


def lock(fd: int, path: str | Path, purpose: str, remedy: str, exclusive: bool = True,
         blocking: bool = True) -> bool:
    """flock `fd` (the open file `path`); False when another process holds it and
    `blocking` is off. A filesystem without file locks is one line: `path`, what the lock
    is for (`purpose`: "the ops' build lock") and what to do (`remedy`)."""
    mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    try:
        fcntl.flock(fd, mode | (0 if blocking else fcntl.LOCK_NB))
        return True
    except BlockingIOError:
        return False
    except OSError as e:  # ENOLCK, EOPNOTSUPP: a filesystem without file locks
        raise UserError(f"{path}: {purpose} needs file locks, which its filesystem refuses "
                        f"({e.strerror}): {remedy}") from None


@contextlib.contextmanager
def held(path: str | Path, purpose: str, remedy: str,
         waiting: Callable[[], None] = lambda: None):
    """`path` locked exclusively for the block (created if missing; the file stays).
    `waiting()` is called once before waiting for another holder."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if not lock(fd, path, purpose, remedy, blocking=False):
            waiting()
            lock(fd, path, purpose, remedy)
        yield
    finally:
        os.close(fd)  # closing releases the lock
