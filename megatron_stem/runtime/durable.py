"""Writing files so that a crash or a full disk loses nothing and says what happened.

Small JSON records (`write_json`, `read_json`) are whole or absent: preprocessing's resume
rests on them, a record saying that what it describes is on disk."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Optional


def write_durably(path: Path, text: str) -> None:
    """Replace `path` with `text` so that a crash leaves the old file or the new one, whole:
    a temporary file, fsynced, renamed over it, then the folder fsynced (the rename)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def fsync_path(path: str | Path) -> None:
    """Make a file's contents, or a folder's entries (a rename, a new file), durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_folders(root: str | Path) -> None:
    """Make the entries of `root` and of every folder under it durable (new files, renames;
    the files' contents are their writers' to fsync)."""
    for folder, _, _ in os.walk(root):
        fsync_path(folder)


FULL_BYTES = 64 << 20  # less free space than this after a failed write: the disk is full


def full(folder: str | Path, error: BaseException) -> bool:
    """Whether `error`, raised while writing under `folder`, is a full disk (or quota):
    the errno of the first OSError with one in its chain, else the free space left
    (megatron's and torch's writers report it as `unexpected pos 704 vs 598` or `Worker
    failure`, with no errno)."""
    while error is not None:
        if isinstance(error, OSError) and error.errno is not None:
            return error.errno in (errno.ENOSPC, errno.EDQUOT)
        error = error.__cause__ or error.__context__
    try:
        return shutil.disk_usage(folder).free < FULL_BYTES
    except OSError:
        return False


def read_json(path: str) -> Optional[dict]:
    """The record at `path`, or None when there is none (or it is not JSON: a hand-edited
    file; atomic writes never leave half a record)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except ValueError:
        return None


def write_json(path: str, obj) -> None:
    """Write `obj` to `path` atomically and durably (so that the rename survives a crash)."""
    write_durably(Path(path), json.dumps(obj, indent=1))
