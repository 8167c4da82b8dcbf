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

import os
import shutil
import struct
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from megatron_stem.errors import UserError

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
    def lengths_offset(self) -> int:
        return _HEADER_SIZE

    @property
    def pointers_offset(self) -> int:
        return _HEADER_SIZE + 4 * self.sequences

    @property
    def documents_offset(self) -> int:
        return _HEADER_SIZE + 12 * self.sequences


def read_header(path: str) -> IndexHeader:
    with open(path, "rb") as f:
        raw = f.read(_HEADER_SIZE)
    if len(raw) < _HEADER_SIZE or raw[:len(_HEADER)] != _HEADER:
        raise UserError(f"{path}: not a Megatron .idx file")
    version, code, sequences, documents = struct.unpack("<QBQQ", raw[len(_HEADER):])
    if version != _VERSION or code not in _CODE_DTYPES:
        raise UserError(f"{path}: unsupported .idx version {version} / dtype code {code}")
    return IndexHeader(_CODE_DTYPES[code], sequences, documents)


def check_whole(prefix: str) -> IndexHeader:
    """The header of a prefix whose two files agree: the `.idx` as long as its counts say,
    and the `.bin` ending where its last sequence does (one pointer and one length read,
    not the index). A truncated or mismatched pair is a UserError naming the file."""
    index, tokens = idx_path(prefix), bin_path(prefix)
    header = read_header(index)
    expected = header.documents_offset + 8 * header.documents
    if os.path.getsize(index) != expected:
        raise UserError(f"{index}: {os.path.getsize(index):,} bytes, but its header's counts "
                        f"make {expected:,} (truncated, or written by an interrupted job)")
    end = 0
    if header.sequences:
        with open(index, "rb") as f:
            f.seek(header.lengths_offset + 4 * (header.sequences - 1))
            (length,) = struct.unpack("<i", f.read(4))
            f.seek(header.pointers_offset + 8 * (header.sequences - 1))
            (pointer,) = struct.unpack("<q", f.read(8))
        end = pointer + length * np.dtype(header.dtype).itemsize
    if os.path.getsize(tokens) != end:
        raise UserError(f"{tokens}: {os.path.getsize(tokens):,} bytes, but {index} ends its "
                        f"last sequence at {end:,} (not the pair that was written together)")
    return header


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
        with open(idx_path(self.prefix), "wb") as f:
            _write_header(f, self.dtype, len(lengths), len(lengths) + 1)
            f.write(lengths.tobytes())
            f.write(_pointers(lengths, 0, np.dtype(self.dtype).itemsize).tobytes())
            f.write(np.arange(len(lengths) + 1, dtype=np.int64).tobytes())
            _finish(f, sync)


def sync(prefix: str) -> None:
    """Flush a written `.bin/.idx` pair to disk."""
    for path in (bin_path(prefix), idx_path(prefix)):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


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
    headers = [read_header(idx_path(p)) for p in parts]
    for p, h in zip(parts, headers):
        if h.dtype != dtype:
            raise UserError(f"{idx_path(p)}: holds {np.dtype(h.dtype).name} tokens, "
                            f"expected {np.dtype(dtype).name}")
    itemsize = np.dtype(dtype).itemsize
    sequences = sum(h.sequences for h in headers)
    documents = 1 + sum(h.documents - 1 for h in headers)

    # Unbuffered: the kernel-side copy moves the files' offsets under Python's feet.
    with open(bin_path(out_prefix), "wb", buffering=0) as out:
        for p in parts:
            with open(bin_path(p), "rb", buffering=0) as f:
                _copy(f, out)
        _finish(out)

    with open(idx_path(out_prefix), "wb") as out:
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
