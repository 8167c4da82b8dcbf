"""A chunk's texts as Arrow string arrays, parsed natively: no Python code per record.

The fast way through `worker.tokenize_chunk`. It must give exactly the documents and
skips that the per-record readers (`readers.iter_records`) give, so it takes only the
chunks it can prove are clean and answers None for the rest, which then go the
per-record way (that finds and locates every bad record):

- JSON Lines: the chunk must be valid UTF-8, every line exactly one JSON object from `{`
  to `}` (checked on the bytes: a line holding two objects, or an object spread over two
  lines, would be read differently by Arrow), no blank lines, and Arrow's JSON reader
  must accept it with every key a string (it rejects what Python's `json` rejects here,
  and lone surrogates and duplicate keys besides).
- Parquet: the key columns must be string columns.
- Plain text: the chunk must be valid UTF-8.

Either way no text may be missing (null).

Empty and whitespace-only texts are common in real corpora, so they are handled here:
skipped with their line, found by their first byte and, where that could start a
whitespace character, by Python's own `str.isspace`, so that both ways agree on what is
blank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from megatron_stem.data.readers import EMPTY, Chunk, Skip

# Every character Python's str.isspace() accepts (a text of only these is skipped as empty;
# a test checks the list against Python's Unicode database).
WHITESPACE = ("\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0\u1680"
              "\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
              "\u2028\u2029\u202f\u205f\u3000")


@dataclass
class Columns:
    texts: list  # per key, an Arrow string array of the chunk's documents
    skips: list  # the records skipped for an empty text, in order


def chunk_columns(chunk: Chunk, keys: Sequence[str]) -> Optional[Columns]:
    """The chunk's documents per key, or None when the chunk must go record by record."""
    if chunk.shard.kind == "jsonl":
        return _jsonl_columns(chunk, keys)
    if chunk.shard.kind == "parquet":
        return _parquet_columns(chunk, keys)
    return _txt_columns(chunk)


def _jsonl_columns(chunk: Chunk, keys: Sequence[str]) -> Optional[Columns]:
    import pyarrow as pa
    import pyarrow.json as pa_json

    data = chunk.data
    lines = _one_object_per_line(data)
    if lines is None or not _valid_utf8(data):
        return None
    try:
        table = pa_json.read_json(
            pa.BufferReader(data),
            read_options=pa_json.ReadOptions(use_threads=False, block_size=len(data)),
            parse_options=pa_json.ParseOptions(
                explicit_schema=pa.schema([(k, pa.string()) for k in keys]),
                unexpected_field_behavior="ignore"))
    except pa.ArrowInvalid:  # bad JSON, a key that is not a string, a lone surrogate, ...
        return None
    if table.num_rows != lines:
        return None
    return _documents([_array(table.column(k)) for k in keys], keys, chunk.first_line)


def _one_object_per_line(data: bytes) -> Optional[int]:
    """The number of lines when each is `{...}` (optionally ending in \\r): every line
    break sits between a `}` and a `{`. Else None."""
    end = len(data) - data.endswith(b"\n")
    end -= data[:end].endswith(b"\r")
    if end < 2 or data[0] != ord("{") or data[end - 1] != ord("}"):
        return None
    text = np.frombuffer(data, np.uint8, end)
    breaks = np.flatnonzero(text == ord("\n"))
    if len(breaks):
        before = text[breaks - 1]
        crlf = before == ord("\r")
        before[crlf] = text[breaks[crlf] - 2]  # breaks[0] > 1: the text starts with "{"
        if (before != ord("}")).any() or (text[breaks + 1] != ord("{")).any():
            return None
    return len(breaks) + 1


def _valid_utf8(data: bytes) -> bool:
    import pyarrow as pa

    buffer = pa.py_buffer(data)
    offsets = pa.py_buffer(np.array([0, len(data)], np.int64).tobytes())
    try:
        pa.Array.from_buffers(pa.large_string(), 1, [None, offsets, buffer]).validate(full=True)
    except pa.ArrowInvalid:
        return False
    return True


def _txt_columns(chunk: Chunk) -> Optional[Columns]:
    """Every line not blank in ASCII terms (the per-record reader's `bytes.isspace`), less
    its trailing carriage returns."""
    import pyarrow as pa
    import pyarrow.compute as pc

    data = chunk.data
    if not data or not _valid_utf8(data):
        return None
    ends = np.flatnonzero(np.frombuffer(data, np.uint8) == ord("\n")) + 1
    offsets = np.concatenate(([0], ends, [] if data.endswith(b"\n") else [len(data)]))
    lines = pa.LargeStringArray.from_buffers(
        len(offsets) - 1, pa.py_buffer(offsets.astype(np.int64)), pa.py_buffer(data))
    lines = pc.utf8_rtrim(lines, characters="\r\n")
    blank = pc.match_substring_regex(lines, "^[\t\n\x0b\x0c\r ]*$")
    return Columns([lines.filter(pc.invert(blank))], [])


def _parquet_columns(chunk: Chunk, keys: Sequence[str]) -> Optional[Columns]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(chunk.shard.path).read_row_groups(
            list(chunk.row_groups), columns=list(keys), use_threads=False)
    except (pa.ArrowException, OSError):
        return None  # the per-record way reports the row where it broke
    columns = [_array(table.column(k)) for k in keys]
    if any(not (pa.types.is_string(c.type) or pa.types.is_large_string(c.type))
           for c in columns):
        return None
    return _documents(columns, keys, chunk.first_line)


def _array(column: "pyarrow.ChunkedArray") -> "pyarrow.Array":  # noqa: F821
    """One array of the column's texts; combine_chunks copies even a single chunk."""
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()


def _documents(columns: list, keys: Sequence[str], first_line: int) -> Optional[Columns]:
    """Drop the records with an empty or blank text, each a `Skip` like the per-record
    readers make (the first such key of the record is named). None if a text is missing
    (null)."""
    if any(c.null_count for c in columns):
        return None
    blank = [_blank(c) for c in columns]
    dropped = np.logical_or.reduce(blank)
    if not dropped.any():
        return Columns(columns, [])
    skips = []
    for row in np.flatnonzero(dropped).tolist():  # the skipped records only
        key = next(k for k, b in zip(keys, blank) if b[row])
        skips.append(Skip(first_line + row, EMPTY, f"{key!r} is empty"))
    return Columns([_kept(c, dropped) for c in columns], skips)


# The first bytes of the whitespace characters' UTF-8: a text starting with any other byte
# is not blank.
_MAY_START_BLANK = np.zeros(256, bool)
_MAY_START_BLANK[[c.encode()[0] for c in WHITESPACE]] = True
_HEAD = 256  # bytes of a text decoded to tell whether it is blank, before all of it


def _blank(texts: "pyarrow.Array") -> np.ndarray:  # noqa: F821
    """Per text: whether it is empty or all whitespace, as Python's `str.isspace` says.

    Decided for most texts at once by their first byte; the rest (a text starting with
    a space, a newline, or a byte that some whitespace character starts with) by Python
    on their first `_HEAD` bytes, and on the whole text only if those are all whitespace.
    numpy on the Arrow buffers, not Arrow compute: importing pyarrow.compute takes 0.05 s
    of CPU, holding the GIL, in the first chunk of every run."""
    offsets, chars = string_buffers(texts)
    starts, ends = offsets[:-1], offsets[1:]
    blank = starts == ends
    maybe = np.flatnonzero(~blank)
    maybe = maybe[_MAY_START_BLANK[chars[starts[maybe]]]]
    for i in maybe.tolist():
        text = chars[starts[i]:ends[i]]
        # A character cut at the end of the head is dropped: the head holds only whole ones.
        if bytes(text[:_HEAD]).decode("utf-8", "ignore").isspace():
            blank[i] = bytes(text).decode("utf-8").isspace()
    return blank


def _kept(texts: "pyarrow.Array", dropped: np.ndarray) -> "pyarrow.Array":  # noqa: F821
    """`texts` without the dropped ones: slices of the kept runs, joined."""
    import pyarrow as pa

    edges = np.flatnonzero(np.diff(np.concatenate(([True], dropped, [True])).astype(np.int8)))
    runs = [texts.slice(start, stop - start) for start, stop in edges.reshape(-1, 2).tolist()]
    return pa.concat_arrays(runs) if runs else texts.slice(0, 0)


def string_buffers(texts: "pyarrow.Array") -> tuple[np.ndarray, np.ndarray]:  # noqa: F821
    """An Arrow string array's offsets (int64, one more than the texts) and UTF-8 bytes,
    as numpy arrays over its buffers (numpy's own view of an Arrow array imports pandas)."""
    import pyarrow as pa

    width = 8 if pa.types.is_large_string(texts.type) else 4
    _, offsets, data = texts.buffers()
    offsets = np.frombuffer(offsets, np.int32 if width == 4 else np.int64, len(texts) + 1,
                            texts.offset * width).astype(np.int64)
    chars = np.frombuffer(data, np.uint8) if data is not None else np.zeros(0, np.uint8)
    return offsets, chars
