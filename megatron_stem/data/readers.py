"""Input shards: finding them, cutting them into chunks, and parsing records into texts.

Formats, told by the file name (a document is):

- `*.jsonl`, `*.json` (JSON Lines, as Dolma names them): one JSON object per line, whose
  text fields `--json-keys` name;
- `*.txt`: one non-blank line (its field is `text`);
- any of those + `.gz`, `.zst` or `.zstd`: the same, compressed;
- `*.parquet`: one row; `--json-keys` name its string columns.

A chunk is a run of whole lines (or Parquet row groups) of about `chunk_bytes`, cut where
only the file's content decides (never where a read happened to end), so a chunk is the
same in every run: the unit of parallel work and of resume.

Every record that cannot become a document is a `Skip` with its line (row for Parquet),
a reason from `SKIP_REASONS` and a detail; nothing is dropped without one.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import zlib
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Union

from megatron_stem.runtime.errors import UserError

BAD_JSON, MISSING_KEY, NOT_TEXT, BAD_UTF8, EMPTY, READ_ERROR = (
    "bad_json", "missing_key", "not_text", "bad_utf8", "empty", "read_error")
SKIP_REASONS = (BAD_JSON, MISSING_KEY, NOT_TEXT, BAD_UTF8, EMPTY, READ_ERROR)

_KINDS = {".jsonl": "jsonl", ".json": "jsonl", ".txt": "txt", ".parquet": "parquet"}
_COMPRESSIONS = {".gz": "gz", ".zst": "zst", ".zstd": "zst"}
SUPPORTED = "*.jsonl, *.json, *.txt (optionally .gz/.zst), *.parquet"
_BLOCK = 1 << 20  # bytes read (after decompression) per step


@dataclass(frozen=True)
class Shard:
    """One input file."""

    path: str  # absolute
    kind: str  # jsonl | txt | parquet
    compression: Optional[str]  # None | gz | zst
    size: int
    mtime_ns: int

    def identity(self) -> dict:
        """What must match for work done on this file by an earlier run to be reused."""
        return {"path": self.path, "size": self.size, "mtime_ns": self.mtime_ns}


def shard_format(path: str) -> Optional[tuple[str, Optional[str]]]:
    """(kind, compression) told by the name, or None for a name we do not read."""
    root, ext = os.path.splitext(path.lower())
    compression = _COMPRESSIONS.get(ext)
    if compression:
        root, ext = os.path.splitext(root)
    kind = _KINDS.get(ext)
    if kind is None or (kind == "parquet" and compression):
        return None
    return kind, compression


def _shard(path: str) -> Shard:
    kind, compression = shard_format(path)
    st = os.stat(path)
    return Shard(os.path.abspath(path), kind, compression, st.st_size, st.st_mtime_ns)


def find_shards(inputs: Sequence[str],
                exclude: Sequence[str] = ()) -> tuple[list[Shard], list[str]]:
    """Expand files, globs and folders (searched recursively) into shards, in a fixed order:
    the order of `inputs`, each expansion sorted. Paths in `exclude`, or inside a folder of
    `exclude` (our own outputs, when they sit among the inputs), are left out.

    Returns the shards and the files of searched folders that were passed over because
    their names are not a supported format (a named file or glob match must be supported).
    """
    excluded = [os.path.abspath(e) for e in exclude]

    def is_excluded(path: str) -> bool:
        return any(path == e or path.startswith(e + os.sep) for e in excluded)

    paths, ignored = [], []
    for spec in inputs:
        if os.path.isdir(spec):
            for root, dirs, files in os.walk(spec):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                for name in sorted(files):
                    path = os.path.join(root, name)
                    if name.startswith(".") or is_excluded(os.path.abspath(path)):
                        continue
                    (paths if shard_format(name) else ignored).append(path)
        elif glob.has_magic(spec):
            matches = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
            if not matches:
                raise UserError(f"--input {spec}: the pattern matches no file")
            paths.extend(matches)
        elif os.path.isfile(spec):
            paths.append(spec)
        else:
            raise UserError(f"--input {spec}: no such file or folder")
    shards, seen = [], set()
    for path in paths:
        full = os.path.abspath(path)
        if full in seen or is_excluded(full):
            continue
        seen.add(full)
        if shard_format(path) is None:
            raise UserError(f"--input {path}: unsupported file type (supported: {SUPPORTED})")
        shards.append(_shard(path))
    if not shards:
        raise UserError(f"--input {' '.join(inputs)}: no input files found "
                        f"(supported: {SUPPORTED})")
    return shards, ignored


@dataclass(frozen=True)
class Skip:
    """A record (or, with line 0, a whole file) that did not become a document."""

    line: int  # 1-based line, or row for Parquet; 0 when it concerns the whole file
    reason: str  # one of SKIP_REASONS
    detail: str
    count: int = 1  # records lost (a missing Parquet column loses every row at once)

    def describe(self, path: str) -> str:
        where = f"{path}:{self.line}" if self.line else path
        return f"{where}: {self.reason}: {self.detail}"


@dataclass(frozen=True)
class Chunk:
    """A unit of work: whole lines of a text shard, or row groups of a Parquet shard."""

    shard: Shard
    index: int
    first_line: int  # line (row) number of the chunk's first record, 1-based
    disk_bytes: int  # share of the file's on-disk size (for progress and ETA)
    input_bytes: int  # uncompressed bytes the chunk covers (for MB/s)
    data: bytes = b""  # text formats: the lines
    row_groups: tuple = ()  # parquet: the row group indices


def read_chunks(shard: Shard, keys: Sequence[str],
                chunk_bytes: int) -> Iterator[Union[Chunk, Skip]]:
    """Cut a shard into chunks. A file that cannot be read to its end (a truncated gzip, a
    corrupt Parquet footer) yields its readable chunks, then a `Skip` of reason read_error."""
    if shard.kind == "parquet":
        return _parquet_chunks(shard, keys, chunk_bytes)
    return _text_chunks(shard, chunk_bytes)


def iter_records(chunk: Chunk, keys: Sequence[str]) -> Iterator[Union[list, Skip]]:
    """The chunk's documents, each the list of its texts (one per key), or a `Skip`."""
    if chunk.shard.kind == "jsonl":
        return _jsonl_records(chunk, keys)
    if chunk.shard.kind == "txt":
        return _txt_records(chunk)
    return _parquet_records(chunk, keys)


# --- text formats ------------------------------------------------------------------------


def _read_errors() -> tuple:
    errors = [EOFError, OSError, zlib.error]  # gzip.BadGzipFile is an OSError
    try:
        import zstandard

        errors.append(zstandard.ZstdError)
    except ImportError:
        pass
    return tuple(errors)


def _blocks(raw, compression: str) -> Iterator[tuple[bytes, int]]:
    """Decompressed blocks of a compressed file, each with the on-disk position reached."""
    if compression == "zst":
        yield from _zstd_blocks(raw)
        return
    # read1: whatever one step decompressed, so that a truncated file gives up all its
    # data before raising (read(n) would drop the partial block with the exception).
    read = gzip.GzipFile(fileobj=raw).read1
    while block := read(_BLOCK):
        yield block, raw.tell()


def _zstd_blocks(raw) -> Iterator[tuple[bytes, int]]:
    # zstandard's stream_reader returns a silent EOF on a truncated file; a decompressobj
    # tells whether the last frame was complete.
    try:
        import zstandard
    except ImportError:
        raise UserError(f"{raw.name}: reading .zst files needs the `zstandard` package "
                        "(pip install -r requirements.txt)") from None
    dctx = zstandard.ZstdDecompressor()
    frame, in_frame = dctx.decompressobj(), False
    while data := raw.read(_BLOCK):
        while data:
            out = frame.decompress(data)
            in_frame = True
            if out:
                yield out, raw.tell()
            if frame.eof:  # a file may hold several frames back to back
                data, frame, in_frame = frame.unused_data, dctx.decompressobj(), False
            else:
                data = b""
    if in_frame:
        raise EOFError("zstd stream ended before the end of its frame")


class _Cutter:
    """Makes a text shard's chunks in order: their index, first line and share of the
    file on disk."""

    def __init__(self, shard: Shard):
        self.shard, self.index, self.line, self.disk_done = shard, 0, 1, 0

    def __call__(self, data: bytes, disk_end: int) -> Chunk:
        chunk = Chunk(self.shard, self.index, self.line, max(disk_end - self.disk_done, 0),
                      len(data), data=data)
        self.line += _count_lines(data)
        self.index += 1
        self.disk_done = max(self.disk_done, disk_end)
        return chunk


def _count_lines(data: bytes) -> int:
    # numpy, not bytes.count: four times faster, and it lets the worker threads run.
    import numpy as np

    return int(np.count_nonzero(np.frombuffer(data, np.uint8) == ord("\n")))


def _text_chunks(shard: Shard, chunk_bytes: int) -> Iterator[Union[Chunk, Skip]]:
    # A chunk ends at the first newline at or after `chunk_bytes` from its start.
    if shard.compression is None:
        return _plain_chunks(shard, chunk_bytes)
    return _decompressed_chunks(shard, chunk_bytes)


def _plain_chunks(shard: Shard, chunk_bytes: int) -> Iterator[Union[Chunk, Skip]]:
    """An uncompressed file's chunks, each read with one read of its own bytes: the main
    process copies nothing (joining and cutting blocks was a tenth of a run's CPU time)."""
    cut, start = _Cutter(shard), 0
    try:
        with open(shard.path, "rb", buffering=0) as raw:
            while True:
                end = _line_end(raw.fileno(), start + chunk_bytes - 1)
                data = _pread(raw.fileno(), start, end)
                if not data:
                    return
                yield cut(data, start + len(data))
                if end is None:
                    return
                start = end
    except _read_errors() as e:
        yield Skip(cut.line, READ_ERROR, f"file ends early or is corrupt ({e})")


def _line_end(fd: int, offset: int) -> Optional[int]:
    """The offset just past the first newline at or after `offset`; None if there is none
    before the end of the file."""
    size = 1 << 16
    while block := os.pread(fd, size, offset):
        newline = block.find(b"\n")
        if newline >= 0:
            return offset + newline + 1
        offset, size = offset + len(block), min(2 * size, _BLOCK << 4)
    return None


def _pread(fd: int, start: int, end: Optional[int]) -> bytes:
    """The bytes from `start` to `end` (None: to the end of the file)."""
    if end is None:
        end = max(os.fstat(fd).st_size, start)
    data = os.pread(fd, end - start, start)
    while len(data) < end - start:  # a short read; a file that shrank gives what is left
        more = os.pread(fd, end - start - len(data), start + len(data))
        if not more:
            break
        data += more
    return data


def _decompressed_chunks(shard: Shard, chunk_bytes: int) -> Iterator[Union[Chunk, Skip]]:
    pending: list[bytes] = []
    size, position = 0, 0
    cut = _Cutter(shard)
    try:
        with open(shard.path, "rb") as raw:
            for block, position in _blocks(raw, shard.compression):
                pending.append(block)
                size += len(block)
                if size < chunk_bytes:
                    continue
                data, start = b"".join(pending), 0
                while end := data.find(b"\n", start + chunk_bytes - 1) + 1:
                    yield cut(data[start:end], position)
                    start = end
                pending = [data[start:]] if start < len(data) else []
                size = len(data) - start
    except _read_errors() as e:
        data = b"".join(pending)
        end = data.rfind(b"\n") + 1  # the partial line before the break is lost with it
        if end:
            yield cut(data[:end], position)
        yield Skip(cut.line, READ_ERROR, f"file ends early or is corrupt ({e})")
        return
    if pending:
        yield cut(b"".join(pending), shard.size)


def _lines(chunk: Chunk) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of the chunk's non-blank lines."""
    for offset, raw in enumerate(chunk.data.split(b"\n")):
        if raw and not raw.isspace():
            yield chunk.first_line + offset, raw


_DECODER = json.JSONDecoder()


def _parse_json(raw: bytes):
    text = raw.decode("utf-8")
    try:  # the C scanner straight away: a third of json.loads's time on short lines
        record, end = _DECODER.raw_decode(text)
        if end == len(text) or text[end:].isspace():
            return record
    except ValueError:
        pass
    return json.loads(text)  # leading blanks, or a bad line: json.loads says what is wrong


def _jsonl_records(chunk: Chunk, keys: Sequence[str]) -> Iterator[Union[list, Skip]]:
    for line, raw in _lines(chunk):
        try:
            record = _parse_json(raw)
        except UnicodeDecodeError as e:
            yield Skip(line, BAD_UTF8, f"invalid UTF-8 byte at column {e.start + 1}")
            continue
        except ValueError as e:
            yield Skip(line, BAD_JSON, f"{e.msg} (column {e.colno})"
                       if isinstance(e, json.JSONDecodeError) else str(e))
            continue
        if not isinstance(record, dict):
            yield Skip(line, BAD_JSON, f"expected a JSON object, got {type(record).__name__}")
            continue
        yield _texts([record.get(k, _MISSING) for k in keys], keys, line, check_utf8=True)


def _txt_records(chunk: Chunk) -> Iterator[Union[list, Skip]]:
    for line, raw in _lines(chunk):
        try:
            yield [raw.decode("utf-8").rstrip("\r")]
        except UnicodeDecodeError as e:
            yield Skip(line, BAD_UTF8, f"invalid UTF-8 byte at column {e.start + 1}")


_MISSING = object()


def _texts(values: list, keys: Sequence[str], line: int, check_utf8: bool) -> Union[list, Skip]:
    """Validate a record's values; all keys must hold text, so that the datasets of several
    keys stay aligned document by document."""
    for value in values:  # the common case, cheaply: non-blank ASCII strings
        if type(value) is not str or not value.isascii() or not value or value.isspace():
            return _check_texts(values, keys, line, check_utf8)
    return values


def _check_texts(values: list, keys: Sequence[str], line: int,
                 check_utf8: bool) -> Union[list, Skip]:
    for key, value in zip(keys, values):
        if value is _MISSING:
            return Skip(line, MISSING_KEY, f"no key {key!r}")
        if not isinstance(value, str):
            return Skip(line, NOT_TEXT, f"{key!r} is {type(value).__name__}, not a string")
        if not value or value.isspace():
            return Skip(line, EMPTY, f"{key!r} is empty")
        # JSON may escape lone surrogates (\ud800): valid JSON, but not text a tokenizer
        # can take.
        if check_utf8 and not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                return Skip(line, BAD_UTF8, f"{key!r} has an unpaired surrogate at "
                                            f"character {e.start + 1}")
    return values


# --- parquet -----------------------------------------------------------------------------


def _parquet():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise UserError("reading .parquet files needs the `pyarrow` package "
                        "(pip install -r requirements.txt)") from None
    return pyarrow, pyarrow.parquet


def _parquet_chunks(shard: Shard, keys: Sequence[str],
                    chunk_bytes: int) -> Iterator[Union[Chunk, Skip]]:
    pa, pq = _parquet()
    try:
        meta = pq.ParquetFile(shard.path)
        names = meta.schema_arrow.names
        meta = meta.metadata
    except (pa.ArrowException, OSError) as e:
        yield Skip(0, READ_ERROR, f"not a readable Parquet file ({e})")
        return
    missing = [k for k in keys if k not in names]
    if missing:
        yield Skip(0, MISSING_KEY, f"no column {missing[0]!r} (columns: {', '.join(names)})",
                   count=meta.num_rows)
        return
    total = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)) or 1
    groups, size, first, row, index = [], 0, 1, 1, 0
    for i in range(meta.num_row_groups):
        group = meta.row_group(i)
        groups.append(i)
        size += group.total_byte_size
        row += group.num_rows
        if size >= chunk_bytes or i == meta.num_row_groups - 1:
            yield Chunk(shard, index, first, shard.size * size // total, size,
                        row_groups=tuple(groups))
            groups, size, first, index = [], 0, row, index + 1


def _parquet_records(chunk: Chunk, keys: Sequence[str]) -> Iterator[Union[list, Skip]]:
    pa, pq = _parquet()
    row = chunk.first_line
    try:
        batches = pq.ParquetFile(chunk.shard.path).iter_batches(
            batch_size=4096, row_groups=list(chunk.row_groups), columns=list(keys),
            use_threads=False)
        for batch in batches:
            columns = [batch.column(k).to_pylist() for k in keys]
            for values in zip(*columns):
                yield _texts(list(values), keys, row, check_utf8=False)
                row += 1
    except (pa.ArrowException, OSError) as e:
        yield Skip(row, READ_ERROR, f"corrupt Parquet data ({e}); rest of the row groups lost")
