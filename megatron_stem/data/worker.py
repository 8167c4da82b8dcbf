"""The worker side of preprocessing: one chunk of text -> one token part per key.

Runs in spawned processes (`init_worker` loads the tokenizer once per process), or, with
gigatoken, on threads of the main process; either way the main process hands out chunks
and gets back small summaries, never token ids.
"""

from __future__ import annotations

import os
import signal
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from megatron_stem.data.columns import chunk_columns
from megatron_stem.data.encoders import load_encoder
from megatron_stem.data.indexed import PartWriter, bin_path, idx_path
from megatron_stem.data.readers import Chunk, Skip, iter_records
from megatron_stem.data.tokenizer import load_tokenizer
from megatron_stem.runtime import process_lifetime
from megatron_stem.runtime.errors import UserError

_BATCH_DOCS, _BATCH_BYTES = 1024, 1 << 20  # documents per call into the tokenizer


class BadRecord(UserError):
    """A record that cannot be used, under --on-error fail."""


def tokenize_chunk(chunk: Chunk, encoder, keys: Sequence[str], eod: Optional[int],
                   fail: bool, dtype: type, prefixes: dict,
                   report: Callable[[int, int], None] = lambda docs, tokens: None,
                   bos: Optional[int] = None) -> dict:
    """Tokenize a chunk into one part per key (`prefixes[key]`.bin/.idx); return its summary.
    Each document is framed by `bos` before it and `eod` after it, where given.

    A clean chunk is parsed natively and encoded in one call per key (`columns`); any
    other goes record by record, in batches. Under `fail`, the first bad record raises
    `BadRecord` and nothing is written.
    """
    tmp = {k: f"{prefixes[k]}.tmp{os.getpid()}.{threading.get_ident()}" for k in keys}
    writers = {k: PartWriter(tmp[k], dtype) for k in keys}
    skipped, errors = Counter(), []
    docs, tokens = 0, Counter()

    def skip(record: Skip) -> None:
        if fail:
            raise BadRecord(fail_message(record, chunk.shard.path))
        skipped[record.reason] += record.count
        errors.append([record.line, record.reason, record.detail, record.count])

    def write(texts: list) -> None:
        """`texts`: per key, the same documents' texts."""
        nonlocal docs
        batch_tokens = 0
        for key, column in zip(keys, texts):
            flat, lengths = encoder.encode(column)
            if eod is not None or bos is not None:
                flat, lengths = framed(flat, lengths, bos, eod, dtype)
            writers[key].add(flat, lengths)
            tokens[key] += len(flat)
            batch_tokens += len(flat)
        docs += len(texts[0])
        report(len(texts[0]), batch_tokens)

    try:
        columns = chunk_columns(chunk, keys)
        if columns is not None:
            for record in columns.skips:
                skip(record)
            write(columns.texts)
        else:
            for batch in _record_batches(chunk, keys, skip):
                write(batch)
        for w in writers.values():
            w.close(sync=False)  # the main process syncs the part before recording it
    except BaseException:
        for k in keys:
            writers[k].abort()
        raise
    for k in keys:
        os.replace(bin_path(tmp[k]), bin_path(prefixes[k]))
        os.replace(idx_path(tmp[k]), idx_path(prefixes[k]))
    return {"index": chunk.index, "first_line": chunk.first_line, "documents": docs,
            "tokens": {k: tokens[k] for k in keys}, "input_bytes": chunk.input_bytes,
            "skipped": dict(skipped), "errors": errors}


def framed(flat: np.ndarray, lengths: np.ndarray, bos: Optional[int], eod: Optional[int],
           dtype: type) -> tuple[np.ndarray, np.ndarray]:
    """The documents' ids with `bos` before and `eod` after each (None: not that one),
    made in `dtype` in one pass (np.insert, then a cast, took three)."""
    extra = (bos is not None) + (eod is not None)
    out = np.empty(len(flat) + extra * len(lengths), dtype)
    ends = np.cumsum(lengths + extra) - 1  # each document's last place
    tokens = np.ones(len(out), bool)
    if eod is not None:
        tokens[ends] = False
        out[ends] = eod
    if bos is not None:
        starts = ends - (lengths + extra - 1)
        tokens[starts] = False
        out[starts] = bos
    out[tokens] = flat
    return out, lengths + extra


def _record_batches(chunk: Chunk, keys: Sequence[str],
                    skip: Callable[[Skip], None]) -> Iterator[list]:
    """The chunk's documents record by record, grouped into batches (per key, a list of
    texts); skipped records go to `skip`."""
    batch, size = [], 0
    for record in iter_records(chunk, keys):
        if isinstance(record, Skip):
            skip(record)
            continue
        batch.append(record)
        size += sum(map(len, record))
        if len(batch) >= _BATCH_DOCS or size >= _BATCH_BYTES:
            yield [list(texts) for texts in zip(*batch)]
            batch, size = [], 0
    if batch:
        yield [list(texts) for texts in zip(*batch)]


def fail_message(skip: Skip, path: str) -> str:
    return f"{skip.describe(path)} (--on-error fail; --on-error skip counts and skips these)"


@dataclass(frozen=True)
class WorkerSettings:
    tokenizer_type: str
    tokenizer_model: str
    backend: str  # encoders.BACKENDS
    keys: tuple
    eod: Optional[int]
    bos: Optional[int]
    fail: bool
    dtype: str


class ThreadCounters:
    """Documents and tokens tokenized so far, for worker threads: what worker processes
    share as a `multiprocessing.Array("q", 2)`, whose lock is a named semaphore that
    starts multiprocessing's resource tracker (a Python process of its own) to clean up."""

    def __init__(self):
        self._lock, self._values = threading.Lock(), [0, 0]

    def get_lock(self) -> threading.Lock:
        return self._lock

    def __getitem__(self, i: int) -> int:
        return self._values[i]

    def __setitem__(self, i: int, value: int) -> None:
        self._values[i] = value


class ChunkTokenizer:
    """`tokenize_chunk` with fixed settings and one encoder, reporting documents and tokens
    to counters shared with the progress line (`ThreadCounters`, or a
    `multiprocessing.Array` of two across processes).

    A worker process holds one; with gigatoken, which releases the GIL, the main process
    holds one that its worker threads share.
    """

    def __init__(self, settings: WorkerSettings, encoder, counters):
        self.settings, self.encoder, self.counters = settings, encoder, counters

    def __call__(self, chunk: Chunk, prefixes: dict) -> dict:
        s = self.settings
        return tokenize_chunk(chunk, self.encoder, s.keys, s.eod, s.fail,
                              np.dtype(s.dtype).type, prefixes, self._report, s.bos)

    def _report(self, docs: int, tokens: int) -> None:
        with self.counters.get_lock():
            self.counters[0] += docs
            self.counters[1] += tokens


_worker = {}  # per worker process: its ChunkTokenizer


def init_worker(settings: WorkerSettings, counters) -> None:
    # Interrupts are the main process's to handle: it lets running chunks finish and
    # records them. If it dies without doing so (SIGKILL), the watchdog ends the worker.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    process_lifetime.exit_with_parent()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker, like sentencepiece
    tokenizer = load_tokenizer(settings.tokenizer_type, settings.tokenizer_model)
    encoder, _ = load_encoder(tokenizer, settings.backend)
    _worker["tokenize"] = ChunkTokenizer(settings, encoder, counters)


def work(chunk: Chunk, prefixes: dict) -> dict:
    """The task the main process submits: tokenize `chunk` into the parts at `prefixes`."""
    return _worker["tokenize"](chunk, prefixes)
