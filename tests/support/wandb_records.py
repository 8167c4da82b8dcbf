"""Reading an offline W&B run folder back (`<dir>/wandb/offline-run-*/run-<id>.wandb`).

The file is a LevelDB-style log (a 7-byte `:W&B` header, then 32 KiB blocks of records,
each a 7-byte header: CRC, length, type = full/first/middle/last) of `Record` protobufs;
wandb 0.31 ships the protobufs but no reader any more.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path):
    """The raw records of a .wandb file, in order."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B run file"
    position, parts = 7, []
    while position + 7 <= len(data):
        left = BLOCK - position % BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if kind == 0:  # zero padding to the block's end
            position += left
            continue
        parts.append(data[position + 7:position + 7 + length])
        position += 7 + length
        if kind in (FULL, LAST):
            yield b"".join(parts)
            parts = []


def read_run(folder: Path) -> tuple[str, list[tuple[int, dict]], dict]:
    """(run id, [(step, {key: value})] as logged, the run's config) of one offline run."""
    from wandb.proto import wandb_internal_pb2

    (path,) = folder.glob("run-*.wandb")
    run_id, history, config = None, [], {}
    for raw in records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
            config.update(_values(record.run.config.update))
        elif kind == "config":
            config.update(_values(record.config.update))
        elif kind == "history":
            history.append((record.history.step.num, _values(record.history.item)))
    return run_id, history, config


def _values(items) -> dict:
    """{key: value} of a record's items (a key with '/' may come as a nested key)."""
    return {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
