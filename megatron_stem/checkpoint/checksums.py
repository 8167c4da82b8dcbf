"""What a checkpoint's `COMPLETE` marker records of its files, and the check against it.

    COMPLETE = {"model/__0_0.distcp": {"bytes": 813436, "xxh3_64": "9f0c..."}, ...}

Every file of the folder but recipe.yaml (checked by its content, and editable by hand)
gets its size and an xxh3_64 checksum. xxh3 because it is the fastest of those measured
(docs/checkpoints.md, "What is verified when": `python bench/checkpoint_storage.py`), so
verifying a checkpoint costs about what reading it costs. Sizes alone miss damage that keeps a file's length.

A save hashes each file as it writes it (`HashedStream`, in whichever thread writes the
file: shard_writes.py), so its commit reads no file back; files written by other means
(an import, a tool) are hashed at the commit, shared over the ranks (`record`). Checking
is shared too (`check_contents`, a collective under a process group): rank r hashes the
files it wrote (`__r_*.distcp`), the rest go round-robin, so each rank reads about its own
share of a 1B checkpoint (~3 GB at DP32), not all of it. A marker written before checksums
were kept holds sizes only (`{name: bytes}`), or nothing: those are checked as far as they
go.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch.distributed as dist
import xxhash

from megatron_stem.runtime.durable import write_durably
from megatron_stem.runtime.errors import UserError

ALGORITHM = "xxh3_64"
_CHUNK = 16 << 20
_WRITER_OF = re.compile(r"__(\d+)_\d+\.distcp$")  # a dist checkpoint file, by its writer


def digest(path: Path) -> str:
    """The file's xxh3_64, as hex."""
    return entry_of(path)[ALGORITHM]


def entry_of(path: Path, fsync: bool = False) -> dict:
    """{"bytes", "xxh3_64"} of a file, read whole (`fsync`: made durable too)."""
    h, size = xxhash.xxh3_64(), 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
        if fsync:
            os.fsync(f.fileno())
    return {"bytes": size, ALGORITHM: h.hexdigest()}


class HashedStream:
    """A file being written, hashed as its bytes go out (what torch DCP's item writer
    needs of a stream: `write`, `tell`, `flush`)."""

    def __init__(self, file):
        self.file = file
        self._hash = xxhash.xxh3_64()

    def write(self, data) -> int:
        self._hash.update(data)
        return self.file.write(data)

    def tell(self) -> int:
        return self.file.tell()

    def flush(self) -> None:
        self.file.flush()

    def entry(self) -> dict:
        """{"bytes", "xxh3_64"} of what was written so far."""
        return {"bytes": self.file.tell(), ALGORITHM: self._hash.hexdigest()}


def write_file(path: Path, data: bytes) -> dict:
    """Write `data` as `path`, durably; its entry."""
    with open(path, "wb") as f:
        stream = HashedStream(f)
        stream.write(data)
        f.flush()
        os.fsync(f.fileno())
        return stream.entry()


def listed(folder: Path, exclude: str) -> list[str]:
    """The files under `folder` (paths relative to it) but those named `exclude`."""
    return [str(p.relative_to(folder)) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != exclude]


def _mine(names: list[str]) -> list[str]:
    """This rank's share of `names` (all of them without a process group)."""
    if not dist.is_initialized():
        return names
    rank, world = dist.get_rank(), dist.get_world_size()

    def hasher(i: int, name: str) -> int:
        writer = _WRITER_OF.search(name)
        return int(writer[1]) % world if writer else i % world
    return [name for i, name in enumerate(names) if hasher(i, name) == rank]


def _gathered(mine):
    """Every rank's `mine`, in rank order ([mine] without a process group)."""
    if not dist.is_initialized():
        return [mine]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def record(folder: Path, exclude: str, known: dict[str, dict]) -> dict[str, dict]:
    """{file: {"bytes", "xxh3_64"}} of every file under `folder` but `exclude`: `known`,
    this rank's files as their writers hashed them, and every other rank's; the files no
    rank knows (written by other means) hashed now and made durable, shared over the
    ranks. A collective; every rank gets the whole."""
    every = {name: entry for part in _gathered(known) for name, entry in part.items()}
    rest = [name for name in listed(folder, exclude) if name not in every]
    mine = {name: entry_of(folder / name, fsync=True) for name in _mine(rest)}
    return every | {name: entry for part in _gathered(mine) for name, entry in part.items()}


def write(marker: Path, entries: dict[str, dict]) -> None:
    """`entries` as the marker, durably (it says that the folder is whole)."""
    write_durably(marker, json.dumps(entries, indent=0, sort_keys=True))


def read(marker: Path) -> dict[str, dict]:
    """The marker's entries ({name: {"bytes"[, "xxh3_64"]}}); a damaged marker is refused."""
    try:
        entries = json.loads(marker.read_text() or "{}")  # empty: saved before sizes were kept
    except ValueError:  # not UTF-8, not JSON
        entries = None
    if not isinstance(entries, dict) or not all(
            isinstance(v, (int, dict)) for v in entries.values()):
        raise UserError(f"{marker}: damaged (not the JSON object of file sizes and checksums "
                        "it should be)")
    return {name: v if isinstance(v, dict) else {"bytes": v} for name, v in entries.items()}


def check_sizes(folder: Path, entries: dict[str, dict]) -> None:
    """Every recorded file is there at its recorded size (cheap: no file is read)."""
    for name, entry in entries.items():
        file = folder / name
        if not file.is_file():
            raise UserError(f"{file}: missing (the checkpoint was saved with it)")
        if file.stat().st_size != entry["bytes"]:
            raise UserError(f"{file}: {file.stat().st_size} bytes, {entry['bytes']} when saved "
                            "(truncated or overwritten)")


def check_contents(folder: Path, entries: dict[str, dict]) -> None:
    """Every recorded checksum matches (a collective: each rank reads its share; all raise
    the first damage any rank found)."""
    found = None
    for name in _mine(sorted(n for n, e in entries.items() if ALGORITHM in e)):
        if digest(folder / name) != entries[name][ALGORITHM]:
            found = (f"{folder / name}: contents differ from when saved ({ALGORITHM} checksum; "
                     "same size: damaged on disk or overwritten)")
            break
    damage = agreed(found)
    if damage is not None:
        raise UserError(damage)


def agreed(problem: str | None) -> str | None:
    """The first rank's problem that is not None, on every rank (a collective)."""
    return next((p for p in _gathered(problem) if p is not None), None)
