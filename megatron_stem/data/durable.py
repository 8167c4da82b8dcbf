"""Small JSON records that are whole or absent: written to a temporary name, synced, renamed.

Preprocessing's resume rests on them: a record says that what it describes is on disk.
"""

from __future__ import annotations

import json
import os
from typing import Optional


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
    """Write `obj` to `path` atomically and durably (tmp + fsync + rename + fsync of the
    folder, so that the rename itself survives a crash)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    sync_dir(os.path.dirname(os.path.abspath(path)))


def sync_dir(path: str) -> None:
    """Make the renames inside folder `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
