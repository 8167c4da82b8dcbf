"""Small JSON records that are whole or absent (`storage.write_durably`: a temporary name,
synced, renamed, the folder synced).

Preprocessing's resume rests on them: a record says that what it describes is on disk.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from megatron_stem.storage import write_durably


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
