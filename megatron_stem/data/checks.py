"""Token files checked against each other and the model before training reads them.

A `.bin/.idx` pair that does not belong together, or holds ids the model has no row for,
otherwise fails late and far from its cause: a truncated `.bin` when training reaches the
damaged region, an id above the vocabulary as an index error at step 1 naming no file.
`check_token_files` costs a few small reads per prefix, each of only its own pages (the
header and last entries of the `.idx`; for a prefix whose largest id no manifest records,
16 spans of 8 kB of the `.bin`), so every rank runs it at start. The full id check is
preprocessing's (`max_token_id`, in its stats and in a prefix set's manifest, which the
start reads instead of sampling).
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np

from megatron_stem.data.indexed import IndexHeader, bin_path, idx_path, read_header
from megatron_stem.runtime import page_cache
from megatron_stem.runtime.errors import UserError

SAMPLE_SPANS = 16  # where ids are sampled: this many spans spread over the .bin
SPAN_BYTES = 8192  # each two whole pages: 2,048 int32 or 4,096 uint16 ids
_SCAN_TOKENS = 1 << 24  # tokens read at a time by `max_token_id`


def size_text(n: int) -> str:
    """Bytes as people read them: 512 B, 2.5 MB, 4.1 GB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def sizes_text(got: int, wanted: int) -> tuple[str, str]:
    """Two sizes as people read them, in bytes where rounding would make them look equal."""
    if size_text(got) == size_text(wanted):
        return f"{got:,} bytes", f"{wanted:,} bytes"
    return size_text(got), size_text(wanted)


def check_token_files(prefix: str, vocab_size: Optional[int] = None,
                      header: Optional[IndexHeader] = None) -> None:
    """Refuse, in one line naming the file, a `.bin/.idx` pair that cannot be read whole:
    an `.idx` that is not one, or cut short; a `.bin` that is empty, shorter or longer than
    its `.idx` says (truncated, or the `.idx` of another prefix); with `vocab_size`, a
    sampled token id >= it. `header`: the `.idx`'s, when already read."""
    header = header or read_header(idx_path(prefix))
    idx_bytes = os.path.getsize(idx_path(prefix))
    wanted = header.documents_offset + 8 * header.documents
    if idx_bytes != wanted:
        got_text, wanted_text = sizes_text(idx_bytes, wanted)
        raise UserError(f"{idx_path(prefix)} is {got_text} but its header needs "
                        f"{wanted_text} (truncated or damaged)")
    needed = _bin_bytes_needed(prefix, header)
    got = os.path.getsize(bin_path(prefix))
    if got == 0 and needed:
        raise UserError(f"{bin_path(prefix)} is empty but its .idx needs {size_text(needed)}")
    if got != needed:
        what = "truncated, or" if got < needed else "written with"
        got_text, needed_text = sizes_text(got, needed)
        raise UserError(f"{bin_path(prefix)} is {got_text} but its .idx needs "
                        f"{needed_text} ({what} the .idx of another prefix)")
    if vocab_size is not None and got:
        _check_sampled_ids(prefix, header.dtype, got, vocab_size)


def _bin_bytes_needed(prefix: str, header) -> int:
    """The `.bin` size the `.idx` implies: its last sequence's pointer plus its length."""
    if header.sequences == 0:
        return 0
    last = header.sequences - 1
    raw_length, raw_pointer = page_cache.pread_randomly(idx_path(prefix), [
        (header.lengths_offset + 4 * last, 4), (header.pointers_offset + 8 * last, 8)])
    (length,) = np.frombuffer(raw_length, np.int32)
    (pointer,) = np.frombuffer(raw_pointer, np.int64)
    if length < 0 or pointer < 0:
        raise UserError(f"{idx_path(prefix)}: damaged (a negative length or pointer)")
    return int(pointer) + int(length) * np.dtype(header.dtype).itemsize


def _check_sampled_ids(prefix: str, dtype, size: int, vocab_size: int) -> None:
    """SAMPLE_SPANS spans of SPAN_BYTES, page-aligned, spread over the `.bin`."""
    last = max(size - SPAN_BYTES, 0) // page_cache.PAGE * page_cache.PAGE
    starts = np.unique(np.linspace(0, last, SAMPLE_SPANS).astype(np.int64)
                       // page_cache.PAGE * page_cache.PAGE)
    spans = page_cache.pread_randomly(bin_path(prefix),
                                      [(int(s), SPAN_BYTES) for s in starts])
    itemsize = np.dtype(dtype).itemsize
    for raw in spans:
        ids = np.frombuffer(raw[:len(raw) // itemsize * itemsize], dtype)
        bad = ids[(ids >= vocab_size) | (ids < 0)]
        if bad.size:
            raise UserError(f"token id {int(bad[0])} in {bin_path(prefix)} is >= "
                            f"model.vocab_size {vocab_size} (or negative): data made with "
                            "another tokenizer?")


def max_token_id(prefix: str) -> int:
    """The largest token id in `prefix`.bin, read whole (-1 when empty)."""
    dtype = read_header(idx_path(prefix)).dtype
    ids = np.memmap(bin_path(prefix), dtype=dtype, mode="r") \
        if os.path.getsize(bin_path(prefix)) else np.zeros(0, dtype)
    return max((int(ids[i:i + _SCAN_TOKENS].max()) for i in range(0, len(ids), _SCAN_TOKENS)),
               default=-1)
