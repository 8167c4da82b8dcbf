"""The worker side of preprocessing: one chunk of text -> one token part per key.

Runs in spawned processes (`init_worker` loads the tokenizer once per process); the
main process sends chunks and gets back small summaries, never token ids.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass
from itertools import chain
from typing import Callable, Optional, Sequence

import numpy as np

from megatron_stem.data.indexed import PartWriter, bin_path, idx_path
from megatron_stem.data.readers import Chunk, Skip, iter_records
from megatron_stem.errors import UserError
from megatron_stem.tokenizer import Tokenizer, load_tokenizer

_BATCH_DOCS, _BATCH_BYTES = 1024, 1 << 20  # documents per call into the tokenizer


class BadRecord(UserError):
    """A record that cannot be used, under --on-error fail."""


def tokenize_chunk(chunk: Chunk, tokenizer: Tokenizer, keys: Sequence[str], eod: Optional[int],
                   fail: bool, dtype: type, prefixes: dict,
                   report: Callable[[int, int], None] = lambda docs, tokens: None) -> dict:
    """Tokenize a chunk into one part per key (`prefixes[key]`.bin/.idx); return its summary.

    Under `fail`, the first bad record raises `BadRecord` and nothing is written.
    """
    tmp = {k: f"{prefixes[k]}.tmp{os.getpid()}" for k in keys}
    writers = {k: PartWriter(tmp[k], dtype) for k in keys}
    skipped, errors = Counter(), []
    docs, tokens = 0, Counter()
    batch, batch_bytes = [], 0

    def flush():
        nonlocal docs, batch_bytes
        if not batch:
            return
        batch_tokens = 0
        for i, key in enumerate(keys):
            flat, lengths = _flatten(tokenizer.encode_batch([r[i] for r in batch]), eod, dtype)
            writers[key].add(flat, lengths)
            tokens[key] += len(flat)
            batch_tokens += len(flat)
        docs += len(batch)
        report(len(batch), batch_tokens)
        batch.clear()
        batch_bytes = 0

    try:
        for record in iter_records(chunk, keys):
            if isinstance(record, Skip):
                if fail:
                    raise BadRecord(fail_message(record, chunk.shard.path))
                skipped[record.reason] += record.count
                errors.append([record.line, record.reason, record.detail, record.count])
                continue
            batch.append(record)
            batch_bytes += sum(map(len, record))
            if len(batch) >= _BATCH_DOCS or batch_bytes >= _BATCH_BYTES:
                flush()
        flush()
        for w in writers.values():
            w.close()
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


def _flatten(ids: list, eod: Optional[int], dtype: type) -> tuple[np.ndarray, np.ndarray]:
    """Token lists -> (all ids back to back, length of each), without a Python int list."""
    if eod is not None:
        for doc in ids:
            doc.append(eod)
    lengths = np.fromiter(map(len, ids), np.int32, len(ids))
    flat = np.fromiter(chain.from_iterable(ids), dtype, int(lengths.sum(dtype=np.int64)))
    return flat, lengths


def fail_message(skip: Skip, path: str) -> str:
    return f"{skip.describe(path)} (--on-error fail; --on-error skip counts and skips these)"


@dataclass(frozen=True)
class WorkerSettings:
    tokenizer_type: str
    tokenizer_model: str
    keys: tuple
    eod: Optional[int]
    fail: bool
    dtype: str


_worker = {}  # per worker process: settings, tokenizer, shared counters


def init_worker(settings: WorkerSettings, counters) -> None:
    # Interrupts are the main process's to handle: it lets running chunks finish and
    # records them. If it dies without doing so (SIGKILL), the watchdog ends the worker.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker, like sentencepiece
    _worker.update(settings=settings, counters=counters,
                   tokenizer=load_tokenizer(settings.tokenizer_type, settings.tokenizer_model))


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1)
    os._exit(1)


def _report(docs: int, tokens: int) -> None:
    counters = _worker["counters"]
    with counters.get_lock():
        counters[0] += docs
        counters[1] += tokens


def work(chunk: Chunk, prefixes: dict) -> dict:
    """The task the main process submits: tokenize `chunk` into the parts at `prefixes`."""
    s = _worker["settings"]
    return tokenize_chunk(chunk, _worker["tokenizer"], s.keys, s.eod, s.fail,
                          np.dtype(s.dtype).type, prefixes, _report)
