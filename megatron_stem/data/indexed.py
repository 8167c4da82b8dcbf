"""Megatron's `.bin/.idx` token files, written and merged with bounded memory.

The bytes are exactly those of megatron-core's `IndexedDatasetBuilder` (tested against it),
but its builder keeps every sequence length and pointer of the whole corpus in Python lists
(the out-of-memory seen on large shards) and computes pointers in a Python loop. Here a
part is written from numpy arrays, and a merge streams the parts' indices slice by slice.

`.idx` layout (little endian): b"MMIDIDX\\x00\\x00", u64 version 1, u8 dtype code,
u64 sequence count S, u64 document count D, i32 lengths[S], i64 byte pointers[S],
i64 document indices[D] (sequence index where each document starts, plus a final S).
Preprocessing writes one sequence per document, so D = S + 1 and the indices are 0..S.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from megatron_stem.runtime import page_cache
from megatron_stem.runtime.durable import fsync_path, read_json, write_json
from megatron_stem.runtime.errors import UserError

_HEADER = b"MMIDIDX\x00\x00"
_VERSION = 1
_HEADER_SIZE = len(_HEADER) + 8 + 1 + 8 + 8
# megatron.core.datasets.indexed_dataset.DType codes (kept here so worker processes need
# not import megatron-core and torch).
_DTYPE_CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5,
                np.float64: 6, np.float32: 7, np.uint16: 8}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}
# Index entries copied per step while merging: bounds the merge's memory (~16 MB a step).
_SLICE = 1 << 21
# `.bin` bytes copied by `merge_resumable` between two records of its progress: each record
# syncs the output, and a killed merge redoes at most this much.
_JOURNAL_BYTES = 1 << 30


def token_dtype(vocab_size: int) -> type:
    """The token dtype megatron picks for a vocabulary: uint16 below 65,500 ids, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


@dataclass(frozen=True)
class IndexHeader:
    dtype: type
    sequences: int
    documents: int  # entries in the document index (documents + 1)

    @property
    def dtype_code(self) -> int:
        """megatron's `DType` code of the token dtype."""
        return _DTYPE_CODES[self.dtype]

    @property
    def lengths_offset(self) -> int:
        return _HEADER_SIZE

    @property
    def pointers_offset(self) -> int:
        return _HEADER_SIZE + 4 * self.sequences

    @property
    def documents_offset(self) -> int:
        return _HEADER_SIZE + 12 * self.sequences


def read_header(path: str) -> IndexHeader:
    (raw,) = page_cache.pread_randomly(path, [(0, _HEADER_SIZE)])
    if len(raw) < _HEADER_SIZE or raw[:len(_HEADER)] != _HEADER:
        raise UserError(f"{path}: not a Megatron .idx file")
    version, code, sequences, documents = struct.unpack("<QBQQ", raw[len(_HEADER):])
    if version != _VERSION or code not in _CODE_DTYPES:
        raise UserError(f"{path}: unsupported .idx version {version} / dtype code {code}")
    return IndexHeader(_CODE_DTYPES[code], sequences, documents)


def tokens_between(prefix: str, header: IndexHeader, begin: int, end: int) -> int:
    """Tokens of sequences [begin, end) of `prefix`: the difference of two byte pointers
    (past the last sequence, the `.bin`'s size), not a sum of lengths. Megatron's builders
    write each pointer as the sum of the lengths before it, which `checks.check_token_files`
    holds the last one to and building a dataset's indices checks whole (data/sample_cache.py)."""
    wanted = [i for i in (begin, end) if i < header.sequences]
    read = iter(page_cache.pread_randomly(idx_path(prefix), [
        (header.pointers_offset + 8 * i, 8) for i in wanted]))
    pointers = [int(np.frombuffer(next(read), np.int64)[0]) if i < header.sequences
                else os.path.getsize(bin_path(prefix)) for i in (begin, end)]
    return (pointers[1] - pointers[0]) // np.dtype(header.dtype).itemsize


def index_size(documents: int) -> int:
    """Bytes of the `.idx` of `documents` documents, one sequence each."""
    return _HEADER_SIZE + 20 * documents + 8


def _write_header(f, dtype: type, sequences: int, documents: int) -> None:
    f.write(_HEADER + struct.pack("<QBQQ", _VERSION, _DTYPE_CODES[dtype], sequences, documents))


def _pointers(lengths: np.ndarray, start: int, itemsize: int) -> np.ndarray:
    """Byte offset of each sequence, the first at `start`."""
    ends = np.cumsum(lengths, dtype=np.int64) * itemsize + start
    return np.concatenate(([start], ends[:-1])).astype(np.int64)


class PartWriter:
    """Writes one `.bin/.idx` pair, a batch of documents at a time, one sequence each.

    The lengths of the part are kept (4 bytes per document) until `close`: a part is one
    chunk of one input shard, so this stays small whatever the corpus size.
    """

    def __init__(self, prefix: str, dtype: type):
        self.prefix, self.dtype = prefix, dtype
        self._bin = open(bin_path(prefix), "wb")
        self._lengths: list[np.ndarray] = []

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """`tokens`: the documents' ids back to back; `lengths`: tokens per document."""
        self._bin.write(np.ascontiguousarray(tokens, dtype=self.dtype))  # no copy if it is
        self._lengths.append(np.asarray(lengths, dtype=np.int32))

    def abort(self) -> None:
        """Close and delete what was written (the part is not finished)."""
        self._bin.close()
        for path in (bin_path(self.prefix), idx_path(self.prefix)):
            if os.path.exists(path):
                os.remove(path)

    def close(self, sync: bool = True) -> None:
        """Write the index and close. `sync`: flush both files to disk first; a caller
        passing False calls `sync` itself before anything relies on the part."""
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        _finish(self._bin, sync)
        write_index(self.prefix, self.dtype, lengths, sync)


def write_index(prefix: str, dtype: type, lengths: np.ndarray, sync: bool = True) -> None:
    """`prefix.idx` of documents of `lengths` tokens, one sequence each, back to back in
    `prefix.bin`."""
    with open(idx_path(prefix), "wb") as f:
        _write_header(f, dtype, len(lengths), len(lengths) + 1)
        f.write(np.asarray(lengths, dtype=np.int32).tobytes())
        f.write(_pointers(lengths, 0, np.dtype(dtype).itemsize).tobytes())
        f.write(np.arange(len(lengths) + 1, dtype=np.int64).tobytes())
        _finish(f, sync)


def sync(prefix: str) -> None:
    """Flush a written `.bin/.idx` pair to disk."""
    for path in (bin_path(prefix), idx_path(prefix)):
        fsync_path(path)


def _finish(f, sync: bool = True) -> None:
    """Flush to disk (`sync`) before the caller renames or records: a finished name or a
    record never points at lost data."""
    f.flush()
    if sync:
        os.fsync(f.fileno())
    f.close()


def merge(parts: Sequence[str], out_prefix: str, dtype: type) -> IndexHeader:
    """Concatenate datasets of token type `dtype` in order into `out_prefix` (.bin/.idx),
    like megatron's `IndexedDatasetBuilder.add_index` but streaming: memory does not grow
    with the corpus.

    Writes exactly `out_prefix.bin` and `out_prefix.idx`; callers wanting atomicity pass a
    temporary prefix and rename.
    """
    headers = _headers(parts, dtype)
    # Unbuffered: the kernel-side copy moves the files' offsets under Python's feet.
    with open(bin_path(out_prefix), "wb", buffering=0) as out:
        for p in parts:
            _append(p, out)
        _finish(out)
    return _write_index(parts, headers, idx_path(out_prefix), dtype)


def merge_resumable(parts: Sequence[str], out_prefix: str, dtype: type) -> IndexHeader:
    """`merge` that survives being killed: the `.bin` is copied into `out_prefix.tmp.bin`
    and, every `_JOURNAL_BYTES`, synced and journaled (parts copied, bytes) in
    `out_prefix.merge.json`. A rerun with the same parts cuts the temporary file back to
    the journaled size and copies only the parts after it. The outputs appear under their
    names, renamed, only when whole; the journal is then removed.
    """
    headers = _headers(parts, dtype)
    tmp, journal_path = out_prefix + ".tmp", out_prefix + ".merge.json"
    # The parts and their sizes: a journal of other parts is stale.
    source = hashlib.sha256(json.dumps(
        [np.dtype(dtype).name, *[[p, os.path.getsize(bin_path(p))] for p in parts]]
    ).encode()).hexdigest()
    journal = read_json(journal_path)
    kept = os.path.getsize(bin_path(tmp)) if os.path.exists(bin_path(tmp)) else -1
    if journal is None or journal["source"] != source or kept < journal["bytes"]:
        journal = {"source": source, "parts": 0, "bytes": 0}
    mode = "r+b" if kept >= 0 else "wb"
    with open(bin_path(tmp), mode, buffering=0) as out:
        out.truncate(journal["bytes"])  # what was copied after the last record is redone
        out.seek(journal["bytes"])
        unrecorded = 0
        for k in range(journal["parts"], len(parts)):
            unrecorded += _append(parts[k], out)
            if unrecorded >= _JOURNAL_BYTES or k + 1 == len(parts):
                os.fsync(out.fileno())
                journal.update(parts=k + 1, bytes=out.tell())
                write_json(journal_path, journal)
                unrecorded = 0
        _finish(out)
    header = _write_index(parts, headers, idx_path(tmp), dtype)
    os.replace(bin_path(tmp), bin_path(out_prefix))
    os.replace(idx_path(tmp), idx_path(out_prefix))
    fsync_path(os.path.dirname(os.path.abspath(out_prefix)))
    if os.path.exists(journal_path):  # none when there was nothing to copy
        os.remove(journal_path)
    return header


def _headers(parts: Sequence[str], dtype: type) -> list[IndexHeader]:
    headers = [read_header(idx_path(p)) for p in parts]
    for p, h in zip(parts, headers):
        if h.dtype != dtype:
            raise UserError(f"{idx_path(p)}: holds {np.dtype(h.dtype).name} tokens, "
                            f"expected {np.dtype(dtype).name}")
    return headers


def _write_index(parts: Sequence[str], headers: Sequence[IndexHeader], path: str,
                 dtype: type) -> IndexHeader:
    """The `.idx` of the parts' concatenation, streamed slice by slice, synced."""
    itemsize = np.dtype(dtype).itemsize
    sequences = sum(h.sequences for h in headers)
    documents = 1 + sum(h.documents - 1 for h in headers)
    with open(path, "wb") as out:
        _write_header(out, dtype, sequences, documents)
        # The three arrays each span the whole corpus, so the parts are visited three times.
        for p, h in zip(parts, headers):
            for lengths in _slices(p, h, h.lengths_offset, np.int32, h.sequences):
                out.write(lengths.tobytes())
        start = 0
        for p, h in zip(parts, headers):
            for lengths in _slices(p, h, h.lengths_offset, np.int32, h.sequences):
                out.write(_pointers(lengths, start, itemsize).tobytes())
                start += int(lengths.sum(dtype=np.int64)) * itemsize
        out.write(np.zeros(1, np.int64).tobytes())
        offset = 0
        for p, h in zip(parts, headers):
            # A part's document index starts with its own 0, which the previous part's
            # final entry already stands for.
            for doc in _slices(p, h, h.documents_offset + 8, np.int64, h.documents - 1):
                out.write((doc + offset).tobytes())
            offset += h.sequences
        _finish(out)
    return IndexHeader(dtype, sequences, documents)


def _slices(prefix: str, header: IndexHeader, offset: int, dtype: type, count: int):
    if count == 0:
        return
    array = np.memmap(idx_path(prefix), dtype=dtype, mode="r", offset=offset, shape=(count,))
    for i in range(0, count, _SLICE):
        yield np.array(array[i:i + _SLICE])
    del array


def _append(prefix: str, out) -> int:
    """Append the `.bin` of `prefix` to unbuffered file `out`; returns its size."""
    with open(bin_path(prefix), "rb", buffering=0) as f:
        _copy(f, out)
        return os.fstat(f.fileno()).st_size


def _copy(src, dst) -> None:
    """Append unbuffered file `src` to `dst`, in the kernel when possible (no copy through
    Python; a reflink on filesystems that share extents)."""
    try:
        size = os.fstat(src.fileno()).st_size
        while size > 0:
            sent = os.copy_file_range(src.fileno(), dst.fileno(), size)
            if sent == 0:
                break
            size -= sent
        if size == 0:
            return
    except (AttributeError, OSError):  # old kernel, other OS, or a cross-device copy
        pass
    shutil.copyfileobj(src, dst, 1 << 24)
