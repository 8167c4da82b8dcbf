"""Pre-tokenized corpora in MosaicML Streaming's MDS format (ProLong's), as documents.

An MDS dataset is a folder with an `index.json` (format version 2) that lists its shards:
each shard's file (`raw_data`, or `zip_data` when compressed), sample count, and columns
(names, encodings, fixed sizes or none). A shard file is

    uint32 n | uint32 offsets[n + 1] (from the file's start) | n samples

and a sample is the uint32 sizes of its variable-size columns, then each column's bytes,
columns in the index's order. Only the columns asked for are decoded, as NumPy arrays
(`ndarray`, `ndarray:<dtype>`, `ndarray:<dtype>:<shape>`); the others are skipped by size,
whatever their encoding (a pickled column is never unpickled).

ProLong's samples hold `input_ids` (a packed sequence of token ids) and `indices` (the
[start, end) pairs of its documents); `documents` yields those documents one by one, and
`convert` writes them as a Megatron `.bin/.idx` pair (tools/mds_to_megatron.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, TextIO

import numpy as np

from megatron_stem.data.indexed import PartWriter, bin_path, idx_path, token_dtype
from megatron_stem.data.progress import Progress
from megatron_stem.runtime.errors import UserError

INDEX = "index.json"
# MDS's codes for an ndarray's dtype and for its shape's dtype (when not in the encoding).
_VALUE_DTYPES = {8: "uint8", 9: "int8", 16: "uint16", 17: "int16", 18: "float16",
                 32: "uint32", 33: "int32", 34: "float32", 64: "uint64", 65: "int64",
                 66: "float64"}
_SHAPE_DTYPES = {0: "uint8", 1: "uint16", 2: "uint32", 3: "uint64"}


@dataclass(frozen=True)
class Shard:
    path: Path  # the shard file as stored (compressed or not)
    compression: str | None
    samples: int
    names: tuple[str, ...]
    encodings: tuple[str, ...]
    sizes: tuple[int | None, ...]  # bytes of each fixed-size column, None if variable

    def column(self, name: str) -> int:
        if name not in self.names:
            raise UserError(f"{self.path}: no column '{name}' (it has {', '.join(self.names)})")
        encoding = self.encodings[self.names.index(name)]
        if encoding.split(":")[0] != "ndarray":
            raise UserError(f"{self.path}: column '{name}' is encoded as {encoding}, not as "
                            "an ndarray of token ids")
        return self.names.index(name)


def shards(folders: list[str | Path]) -> list[Shard]:
    """Every shard listed by an `index.json` under `folders` (searched recursively), in
    path order, each once (a merged index may list its subfolders' shards again)."""
    indexes = sorted({p.resolve() for f in folders for p in _indexes(Path(f))})
    if not indexes:
        raise UserError(f"--input: no {INDEX} (an MDS dataset) under {' '.join(map(str, folders))}")
    seen, out = set(), []
    for index in indexes:
        for shard in _read_index(index):
            if shard.path not in seen:
                seen.add(shard.path)
                out.append(shard)
    return out


def _indexes(folder: Path) -> list[Path]:
    if not folder.exists():
        raise UserError(f"--input: {folder}: no such file or folder")
    return [folder] if folder.name == INDEX else sorted(folder.rglob(INDEX))


def _read_index(index: Path) -> list[Shard]:
    try:
        meta = json.loads(index.read_text())
        if meta.get("version") != 2:
            raise ValueError(f"index version {meta.get('version')}, not 2")
        out = []
        for s in meta["shards"]:
            if s.get("format") != "mds":
                raise ValueError(f"a shard of format {s.get('format')}, not mds")
            stored = s["zip_data"] if s.get("compression") else s["raw_data"]
            out.append(Shard(index.parent / stored["basename"], s.get("compression"),
                             s["samples"], tuple(s["column_names"]),
                             tuple(s["column_encodings"]), tuple(s["column_sizes"])))
        return out
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{index}: not an MDS index ({e})") from None


def read_shard(shard: Shard) -> bytes:
    if not shard.path.is_file():
        raise UserError(f"{shard.path}: missing (listed in its {INDEX})")
    data = shard.path.read_bytes()
    if shard.compression is None:
        return data
    if shard.compression.split(":")[0] != "zstd":
        raise UserError(f"{shard.path}: compression {shard.compression} is not supported "
                        "(zstd is)")
    import zstandard

    return zstandard.ZstdDecompressor().decompress(data, max_output_size=1 << 34)


def columns(shard: Shard, names: list[str]) -> Iterator[list[np.ndarray]]:
    """For each sample of `shard`, the arrays of columns `names` (views into the shard)."""
    wanted = [shard.column(n) for n in names]
    data = read_shard(shard)
    count = int(np.frombuffer(data, np.uint32, 1)[0])
    if count != shard.samples:
        raise UserError(f"{shard.path}: {count} samples, its {INDEX} says {shard.samples}")
    offsets = np.frombuffer(data, np.uint32, count + 1, 4)
    variable = sum(size is None for size in shard.sizes)
    for i in range(count):
        begin, end = int(offsets[i]), int(offsets[i + 1])
        sizes = iter(np.frombuffer(data, np.uint32, variable, begin).tolist())
        at, spans = begin + 4 * variable, []
        for size in shard.sizes:
            size = next(sizes) if size is None else size
            spans.append((at, at + size))
            at += size
        if at != end:
            raise UserError(f"{shard.path}: sample {i} holds {end - begin} bytes, its columns "
                            f"{at - begin}: not an MDS shard of the columns its index lists")
        yield [_ndarray(shard.encodings[c], data, *spans[c]) for c in wanted]


def _ndarray(encoding: str, data: bytes, begin: int, end: int) -> np.ndarray:
    """One `ndarray[:dtype[:shape]]` value (MDS's four layouts: dtype and shape each in the
    encoding or in the value's first bytes)."""
    _, *args = encoding.split(":")
    at = begin
    if args:
        dtype = args[0]
    else:
        dtype = _VALUE_DTYPES[data[at]]
        at += 1
    if len(args) == 2:
        shape = tuple(int(d) for d in args[1].split(","))
    else:
        ndim, shape_dtype = data[at] >> 2, _SHAPE_DTYPES[data[at] % 4]
        shape = tuple(np.frombuffer(data, shape_dtype, ndim, at + 1).tolist())
        at += 1 + ndim * np.dtype(shape_dtype).itemsize
    return np.frombuffer(data, dtype, (end - at) // np.dtype(dtype).itemsize, at).reshape(shape)


def documents(shard: Shard, tokens: str = "input_ids",
              bounds: str | None = "indices") -> Iterator[np.ndarray]:
    """The documents of `shard`: each sample's `tokens` split at its `bounds` ([start, end)
    pairs), or whole when `bounds` is None."""
    for values in columns(shard, [tokens] + ([bounds] if bounds else [])):
        ids = values[0].reshape(-1)
        if not bounds:
            yield ids
            continue
        for start, end in values[1].reshape(-1, 2).tolist():
            if not 0 <= start < end <= len(ids):
                raise UserError(f"{shard.path}: document [{start}, {end}) is outside its "
                                f"sample of {len(ids)} tokens")
            yield ids[start:end]


def convert(folders: list[str | Path], prefix: str, vocab_size: int, eod: Optional[int],
            tokens: str = "input_ids", bounds: str | None = "indices",
            log: Optional[TextIO] = None, log_interval: float = 10.0) -> dict:
    """Write the documents of the MDS datasets under `folders` (in path order) as the
    `.bin/.idx` pair `prefix`, each followed by `eod` unless it is None; ids must be below
    `vocab_size` (which also sets the dtype). Written under a temporary name and renamed
    when whole. Returns {"documents", "tokens", "shards"}."""
    found = shards(folders)
    progress = Progress(log, sum(s.path.stat().st_size for s in found if s.path.is_file()),
                        log_interval)
    part = f"{prefix}.tmp"
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    writer = PartWriter(part, token_dtype(vocab_size))
    try:
        for shard in found:
            batch = list(documents(shard, tokens, bounds))
            _check_ids(batch, vocab_size, shard)
            if eod is not None:
                batch = [np.append(doc, eod) for doc in batch]
            if batch:
                writer.add(np.concatenate(batch), np.array([len(d) for d in batch]))
            size = shard.path.stat().st_size
            progress.add(docs=len(batch), tokens=sum(len(d) for d in batch),
                         input_bytes=size, disk_bytes=size)
            progress.tick()
        writer.close()
    except BaseException:
        writer.abort()
        raise
    os.replace(bin_path(part), bin_path(prefix))
    os.replace(idx_path(part), idx_path(prefix))  # the index last: it marks the pair whole
    progress.close()
    return {"documents": progress.docs, "tokens": progress.tokens, "shards": len(found)}


def _check_ids(batch: list[np.ndarray], vocab_size: int, shard: Shard) -> None:
    top = max((int(d.max()) for d in batch if len(d)), default=-1)
    if top >= vocab_size:
        raise UserError(f"{shard.path}: token id {top} is not below the tokenizer's vocabulary "
                        f"of {vocab_size}: these shards were tokenized with another tokenizer")
