"""Sharded safetensors, streamed: each file's header is written first (every shape is known
up front), then the tensors one at a time, so no shard is ever assembled in memory.

The format is the documented one (8-byte little-endian header length, JSON header with
dtype/shape/data_offsets, 8-byte aligned, then raw little-endian data); reading goes
through the `safetensors` library itself.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_stem.runtime.errors import UserError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"  # what HF writes for a model that fits one file

_CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
          torch.float64: "F64", torch.int64: "I64", torch.int32: "I32"}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def plan_shards(groups: list[list[Entry]], max_bytes: int) -> list[list[int]]:
    """Indices of the groups of entries (each kept whole) in each shard of at most
    `max_bytes`, in order; a group larger than that gets a shard of its own."""
    shards, current, size = [], [], 0
    for i, group in enumerate(groups):
        group_size = sum(e.nbytes for e in group)
        if current and size + group_size > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(i)
        size += group_size
    if current:
        shards.append(current)
    return shards


def shard_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


class ShardWriter:
    """Write one safetensors file whose entries are declared up front, then `write` each
    tensor in the declared order."""

    def __init__(self, path: Path, entries: list[Entry]):
        self.path = path
        self._pending = list(entries)
        header, offset = {}, 0
        for e in entries:
            header[e.name] = {"dtype": _CODES[e.dtype], "shape": list(e.shape),
                              "data_offsets": [offset, offset + e.nbytes]}
            offset += e.nbytes
        header["__metadata__"] = {"format": "pt"}
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(blob)) + blob)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected = self._pending.pop(0)
        if (name, tuple(tensor.shape), tensor.dtype) != \
                (expected.name, expected.shape, expected.dtype):
            raise RuntimeError(f"{self.path}: wrote {name} {tuple(tensor.shape)} {tensor.dtype}, "
                               f"declared {expected}")  # a bug in the caller
        raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        self._file.write(raw.numpy().data)

    def close(self) -> None:
        self._file.close()
        if self._pending:
            raise RuntimeError(f"{self.path}: {len(self._pending)} declared tensors never written")

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self._file.close()
        return False


def write_index(folder: Path, shards: list[list[Entry]]) -> None:
    weight_map = {e.name: shard_name(i, len(shards)) for i, shard in enumerate(shards)
                  for e in shard}
    total = sum(e.nbytes for shard in shards for e in shard)
    (folder / INDEX).write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


class ShardedReader:
    """Tensors of an HF model folder (an index with shards, or one model.safetensors),
    read one at a time."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        index, single = folder / INDEX, folder / SINGLE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as e:
                raise UserError(f"{index}: not a safetensors index ({e})") from None
        elif single.is_file():
            weight_map = None
        else:
            raise UserError(f"{folder}: no {INDEX} or {SINGLE} (only safetensors weights "
                            "can be imported)")
        files = sorted(set(weight_map.values())) if weight_map else [SINGLE]
        self._handles, self._file_of = {}, {}
        for name in files:
            if not (folder / name).is_file():
                raise UserError(f"{index}: shard {name} is missing")
            handle = safe_open(str(folder / name), framework="pt")
            self._handles[name] = handle
            for key in handle.keys():
                self._file_of[key] = name

    def names(self) -> set[str]:
        return set(self._file_of)

    def file_of(self, name: str) -> str:
        """The file (in the folder) that holds tensor `name`."""
        return self._file_of[name]

    def names_in(self, file: str) -> list[str]:
        """The tensors of one file, in its own order."""
        return list(self._handles[file].keys())

    def entry(self, name: str) -> Entry:
        view = self._handles[self._file_of[name]].get_slice(name)
        return Entry(name, tuple(view.get_shape()), _DTYPES[view.get_dtype()])

    def read(self, name: str) -> torch.Tensor:
        return self._handles[self._file_of[name]].get_tensor(name)
