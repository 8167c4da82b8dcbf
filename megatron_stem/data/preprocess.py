"""Input shards -> Megatron `.bin/.idx` token files: parallel, bounded memory, resumable.

How it works:

1. The main process reads the shards in order (decompressing as it goes) and cuts them
   into chunks (`readers.read_chunks`); a chunk is the same in every run.
2. Workers (`worker.py`) tokenize chunks and write each one as its own small `.bin/.idx`
   part under `<output-prefix>.parts/` (tmp name, rename; the main process then syncs it
   to disk and writes a JSON manifest: a manifest means the part is complete). With gigatoken
   (`encoders.py`, the default where it loads the tokenizer) the workers are threads:
   gigatoken, Arrow's JSON reader and the writes all release the GIL. With the reference
   libraries they are processes, and token ids never travel back to the main process.
   Either way no more than two chunks per worker are in memory at once.
3. When every shard is done, runs of consecutive parts are merged into the prefixes of a
   prefix set, `<output-prefix>_<key>_document/` (`prefix_sets.py`: prefixes closed at a
   size limit, a group file, then `manifest.json`), the stats are written, and the parts
   are removed. With `single_prefix`, all parts are merged into one
   `<output-prefix>_<key>_document.bin/.idx` instead (`indexed.merge_resumable`).

The output depends only on the inputs and settings, not on the worker count nor on how
often the run was interrupted: a rerun skips finished shards (a `done.json`) and chunks
(a manifest) and redoes the rest. The shards can also be split into contiguous groups
among the tasks of a SLURM array (`group_index`/`num_groups`): each task writes its own
group's prefixes, usable as soon as it ends, and one `merge_only` run then writes the
manifest (or, with `single_prefix`, merges every group's parts).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, BrokenExecutor, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Literal, Optional, Sequence, TextIO

import numpy as np

from megatron_stem.data.checks import max_token_id
from megatron_stem.data.encoders import (
    BACKENDS,
    GigatokenEncoder,
    ReferenceEncoder,
    first_difference,
    load_encoder,
)
from megatron_stem.data.indexed import bin_path, idx_path, merge_resumable, sync, token_dtype
from megatron_stem.data.prefix_sets import (
    DEFAULT_MAX_DOCUMENTS,
    DEFAULT_MAX_TOKENS,
    FORMAT,
    MANIFEST,
    MAX_DOCUMENTS,
    GroupWriter,
    Part,
    array_sizes,
    contiguous_groups,
    group_file,
    plan,
    remove_unlisted,
    set_record,
)
from megatron_stem.data.progress import Progress
from megatron_stem.data.readers import (
    SKIP_REASONS,
    Chunk,
    Shard,
    Skip,
    find_shards,
    iter_records,
    read_chunks,
)
from megatron_stem.data.tokenizer import load_tokenizer
from megatron_stem.data.worker import (
    BadRecord,
    ChunkTokenizer,
    ThreadCounters,
    WorkerSettings,
    fail_message,
    init_worker,
    work,
)
from megatron_stem.runtime import durable
from megatron_stem.runtime.durable import read_json, write_json
from megatron_stem.runtime.errors import UserError

# Bump when the parts' layout or content changes: older parts are then redone.
# 2: chunks of at most 8 MiB by default (were 32).
_FORMAT_VERSION = 2
_LIVE_ERRORS = 10  # skipped records printed as they are found; the rest go to the log
_VERIFY_CHARS = 2048  # of each document checked by --verify-tokenizer


def auto_chunk_bytes(shard: Shard) -> int:
    """About a 16th of the file's size on disk, within 1..8 MiB of text: a small corpus
    still spreads over the workers, a large one keeps memory flat (a few chunks per worker
    are in memory) without making millions of part files (a 1 TB corpus makes about
    125,000). Depends on the file alone, so adding inputs never invalidates finished work."""
    return min(max(shard.size // 16, 1 << 20), 8 << 20)


@dataclass
class PreprocessConfig:
    inputs: list[str]
    output_prefix: str
    tokenizer_type: str
    tokenizer_model: str
    json_keys: list[str] = field(default_factory=lambda: ["text"])
    append_eod: bool = False
    prepend_bos: bool = False
    workers: int = 1
    tokenizer_backend: str = "auto"  # encoders.BACKENDS
    verify_docs: int = 32  # gigatoken vs the reference library on a run's first documents
    on_error: Literal["skip", "fail"] = "skip"
    chunk_bytes: Optional[int] = None  # text per unit of work; None: `auto_chunk_bytes`
    log_interval: float = 10.0  # seconds between progress lines when not on a terminal
    group_index: int = 0  # this task processes the group_index-th of num_groups contiguous
    num_groups: int = 1  # runs of the input files (balanced by bytes)
    merge_only: bool = False
    keep_parts: bool = False
    single_prefix: bool = False  # one <prefix>_<key>_document.bin/.idx, not a prefix set
    prefix_max_tokens: int = DEFAULT_MAX_TOKENS  # a prefix set's prefix is closed before
    prefix_max_documents: int = DEFAULT_MAX_DOCUMENTS  # the next part takes it past these

    def validate(self) -> None:
        if self.workers < 1:
            raise UserError(f"--workers: must be >= 1, got {self.workers}")
        if self.tokenizer_backend not in BACKENDS:
            raise UserError(f"--tokenizer-backend: expected one of {', '.join(BACKENDS)}, "
                            f"got {self.tokenizer_backend!r}")
        if self.verify_docs < 0:
            raise UserError(f"--verify-tokenizer: must be >= 0, got {self.verify_docs}")
        if self.chunk_bytes is not None and self.chunk_bytes < 1:
            raise UserError(f"--chunk-size-mb: must be positive, got {self.chunk_bytes} bytes")
        if self.on_error not in ("skip", "fail"):
            raise UserError(f"--on-error: expected skip or fail, got {self.on_error!r}")
        if not self.json_keys or len(set(self.json_keys)) != len(self.json_keys):
            raise UserError(f"--json-keys: expected distinct keys, got {self.json_keys}")
        bad = [k for k in self.json_keys if not re.fullmatch(r"[\w.-]+", k)]
        if bad:  # keys become file names
            raise UserError(f"--json-keys: {bad[0]!r}: use letters, digits, '_', '.', '-'")
        if not 0 <= self.group_index < self.num_groups:
            raise UserError(f"--group-index: {self.group_index} is not in "
                            f"0..{self.num_groups - 1} (--num-groups {self.num_groups})")
        if not self.output_prefix or self.output_prefix.endswith(os.sep):
            raise UserError(f"--output-prefix: {self.output_prefix!r} must name files, "
                            "e.g. data/corpus")
        if not isinstance(self.prefix_max_tokens, int) or self.prefix_max_tokens < 1:
            raise UserError(f"--prefix-max-tokens: must be a whole number >= 1, got "
                            f"{self.prefix_max_tokens!r}")
        if (not isinstance(self.prefix_max_documents, int)
                or not 1 <= self.prefix_max_documents <= MAX_DOCUMENTS):
            raise UserError(f"--prefix-max-documents: must be a whole number in 1..{MAX_DOCUMENTS}"
                            f" (megatron-core holds document ids as int32), got "
                            f"{self.prefix_max_documents!r}")

    def output(self, key: str) -> str:
        """Megatron-LM's naming: <prefix>_<key>_document.{bin,idx} with `single_prefix`,
        else the prefix set's folder of that name."""
        return f"{self.output_prefix}_{key}_document"

    def group_errors_path(self, group: int, num_groups: int) -> str:
        """The skipped records of one group; joined into `errors_path` by the last step."""
        if num_groups == 1:
            return self.errors_path
        return f"{self.output_prefix}.group-{group:05d}-of-{num_groups:05d}.errors.log"

    @property
    def stats_path(self) -> str:
        return self.output_prefix + ".stats.json"

    @property
    def errors_path(self) -> str:
        return self.output_prefix + ".errors.log"

    @property
    def parts_dir(self) -> str:
        return self.output_prefix + ".parts"


# --- the main process --------------------------------------------------------------------


def preprocess(cfg: PreprocessConfig, log: Optional[TextIO] = sys.stderr) -> dict:
    """Run, resume or finish a preprocessing job; return its stats (also written as JSON
    to `cfg.stats_path`). Progress and skipped records go to `log`.

    Workers are spawned processes: a script calling this needs the usual
    `if __name__ == "__main__":` guard.
    """
    cfg.validate()
    try:
        return _Job(cfg, log).run()
    except OSError as e:
        folder = os.path.dirname(os.path.abspath(cfg.output_prefix))
        if not durable.full(folder, e):
            raise
        raise UserError(f"no space left on device writing {e.filename or folder}; the finished "
                        f"parts in {cfg.parts_dir} are kept: free space and rerun the same "
                        "command to resume") from None


@dataclass
class _ShardState:
    shard: Shard
    dir: str
    chunks: int = 0  # cut so far
    pending: int = 0  # submitted, not finished
    read: bool = False  # every chunk has been cut
    failed: bool = False  # a chunk failed: the shard is not done in this run
    errors: list = field(default_factory=list)  # skips concerning the file, not a chunk


class _Job:
    def __init__(self, cfg: PreprocessConfig, log: Optional[TextIO]):
        self.cfg, self.log = cfg, log
        self.tokenizer = load_tokenizer(cfg.tokenizer_type, cfg.tokenizer_model)
        if cfg.append_eod and self.tokenizer.eod is None:
            raise UserError(f"--append-eod: {self.tokenizer.path} has no end-of-document token")
        if cfg.prepend_bos and self.tokenizer.bos is None:
            raise UserError(f"--prepend-bos: {self.tokenizer.path} has no beginning-of-document "
                            "token")
        outputs = [path for key in cfg.json_keys for path in
                   (cfg.output(key), bin_path(cfg.output(key)), idx_path(cfg.output(key)))]
        self.shards, ignored = find_shards(
            cfg.inputs, exclude=outputs + [cfg.stats_path, cfg.errors_path, cfg.parts_dir])
        if ignored:
            self._say(f"note: passed over {len(ignored)} file(s) of unsupported types in the "
                      f"input folders, e.g. {ignored[0]}")
        if cfg.json_keys != ["text"] and any(s.kind == "txt" for s in self.shards):
            raise UserError("--json-keys: plain .txt inputs only have the field 'text'")
        self.keys = list(cfg.json_keys)
        self.dtype = token_dtype(self.tokenizer.vocab_size)
        tok = self.tokenizer.unique_identifiers
        # Everything that changes a part's bytes; the path of the tokenizer does not.
        self.settings = {"format": _FORMAT_VERSION,
                         "tokenizer": {k: tok[k] for k in ("class", "sha256", "vocab_size")},
                         "json_keys": self.keys, "append_eod": cfg.append_eod,
                         "dtype": np.dtype(self.dtype).name,
                         "chunk_bytes": cfg.chunk_bytes or "auto"}
        if cfg.prepend_bos:  # absent when off: outputs made before the flag stay up to date
            self.settings["prepend_bos"] = True
        # What a prefix set's files hold besides their prefixes (manifest.json's header).
        self.header = {"format": FORMAT, "dtype": self.settings["dtype"],
                       "tokenizer": self.settings["tokenizer"], "append_eod": cfg.append_eod}
        self.num_groups = cfg.num_groups
        if cfg.merge_only and not cfg.single_prefix and cfg.num_groups == 1:
            self.num_groups = self._array_size()
        layout = ({"single_prefix": True} if cfg.single_prefix else
                  {"limits": [cfg.prefix_max_tokens, cfg.prefix_max_documents],
                   "num_groups": self.num_groups})
        self.identity = _digest({"settings": self.settings, "layout": layout,
                                 "shards": [s.identity() for s in self.shards]})
        self.run_stats = Counter()  # this run's own work
        self.encoder = None  # made when there is something to tokenize
        self.live_errors = 0

    # -- driver

    def run(self) -> dict:
        start = time.monotonic()
        cfg = self.cfg
        final = cfg.num_groups == 1 or cfg.merge_only
        os.makedirs(os.path.dirname(os.path.abspath(cfg.output_prefix)), exist_ok=True)
        if final:
            stats = self._up_to_date()
            if stats is not None:
                return {**stats, "up_to_date": True}
        prefixes = None
        if not cfg.merge_only:
            shards = self._group_shards(cfg.group_index)
            if cfg.single_prefix:
                self._process(shards)
            else:
                prefixes = self._write_group(cfg.group_index, shards)
        if not final:
            return self._group_stats(time.monotonic() - start, prefixes)
        if cfg.single_prefix:
            return self._finalize_single(time.monotonic() - start)
        return self._finalize_set(time.monotonic() - start)

    def _say(self, text: str) -> None:
        if self.log is not None:
            self.log.write(text + "\n")
            self.log.flush()

    # -- groups

    def _group_shards(self, group: int) -> list:
        """The group's contiguous run of the input files (a run without groups: all)."""
        run = contiguous_groups([s.size for s in self.shards], self.num_groups)[group]
        return self.shards[run.start:run.stop]

    def _array_size(self) -> int:
        """--merge-only without --num-groups: the array size of the newest group files."""
        folder = self.cfg.output(self.keys[0])
        sizes = array_sizes(folder)
        if not sizes:
            raise UserError(f"--merge-only: {folder} holds no group files: run the "
                            "preprocessing tasks first")
        return max(sizes, key=sizes.get)

    def _group_writer(self, group: int, shards: list) -> GroupWriter:
        identity = _digest({"settings": self.settings, "group": [group, self.num_groups],
                            "limits": [self.cfg.prefix_max_tokens,
                                       self.cfg.prefix_max_documents],
                            "shards": [s.identity() for s in shards]})
        progress = os.path.join(self.cfg.parts_dir,
                                f"group-{group:05d}-of-{self.num_groups:05d}.progress.json")
        return GroupWriter({k: self.cfg.output(k) for k in self.keys}, group, self.num_groups,
                           self.dtype, identity, progress)

    def _write_group(self, group: int, shards: list) -> dict:
        """Tokenize the group's files, merge their parts into the group's prefixes and
        record them in its group file, then remove the parts; a group whose group file is
        there already is done. Returns the group file's content per key."""
        cfg = self.cfg
        writer = self._group_writer(group, shards)
        records = writer.done()
        if records is None:
            self._process(shards)
            prefixes, lost = self._plan_group(shards, writer)
            if lost:  # parts released by a run of other settings: those files are redone
                for shard in lost:
                    shutil.rmtree(self._shard_dir(shard))
                self._process(shards)
                prefixes, _ = self._plan_group(shards, writer)
            stats = self._totals(shards, self._all_finished(shards),
                                 cfg.group_errors_path(group, self.num_groups))
            os.makedirs(cfg.parts_dir, exist_ok=True)
            records = writer.write(prefixes, self.header, stats,
                                   release=None if cfg.keep_parts else _remove_parts)
        else:
            self.run_stats["groups_resumed"] += 1
            first_errors = records[self.keys[0]]["stats"]["first_errors"]
            if cfg.on_error == "fail" and first_errors:
                raise BadRecord(first_errors[0] + " (--on-error fail)")
        if not cfg.keep_parts:
            for shard in shards:
                shutil.rmtree(self._shard_dir(shard), ignore_errors=True)
        return records

    def _plan_group(self, shards: list, writer: GroupWriter) -> tuple[list, list]:
        """The group's prefixes (as runs of parts), and the shards with a part that a
        prefix still to be written needs but that is gone."""
        parts = [Part(self._part_prefixes(self._shard_dir(shard), i), chunk["documents"],
                      chunk["tokens"])
                 for shard, done in zip(shards, self._all_finished(shards))
                 for i, chunk in enumerate(self._chunks(shard, done))]
        prefixes = plan(parts, self.cfg.prefix_max_tokens, self.cfg.prefix_max_documents)
        gone = {os.path.dirname(path) for prefix in prefixes[writer.resumed(prefixes):]
                for part in prefix for path in part.prefixes.values()
                if not os.path.exists(bin_path(path))}
        return prefixes, [s for s in shards if self._shard_dir(s) in gone]

    # -- paths and manifests

    def _source(self, shard: Shard) -> dict:
        return {"shard": shard.identity(), "settings": self.settings}

    def _shard_dir(self, shard: Shard) -> str:
        # Named by the path, not the position in the input list, so that adding inputs
        # does not invalidate finished shards.
        digest = hashlib.sha1(shard.path.encode()).hexdigest()[:16]
        name = re.sub(r"[^\w.-]", "_", os.path.basename(shard.path))[:48]
        return os.path.join(self.cfg.parts_dir, f"{name}-{digest}")

    @staticmethod
    def _chunk_json(shard_dir: str, index: int) -> str:
        return os.path.join(shard_dir, f"{index:06d}.json")

    def _chunks(self, shard: Shard, done: dict) -> list:
        """The summaries of a finished shard's chunks, in order."""
        shard_dir = self._shard_dir(shard)
        return [read_json(self._chunk_json(shard_dir, i)) for i in range(done["chunks"])]

    def _part_prefixes(self, shard_dir: str, index: int) -> dict:
        return {k: os.path.join(shard_dir, f"{index:06d}_{k}") for k in self.keys}

    def _finished(self, shard: Shard) -> Optional[dict]:
        done = read_json(os.path.join(self._shard_dir(shard), "done.json"))
        return done if done is not None and done.get("source") == self._source(shard) else None

    def _check_reused(self, shard: Shard, first_error: Optional[list]) -> None:
        """Under --on-error fail, work of an earlier --on-error skip run with skipped
        records must fail like a fresh run would."""
        if self.cfg.on_error == "fail" and first_error:
            raise BadRecord(fail_message(Skip(*first_error), shard.path))

    # -- processing

    def _executor(self):
        """Worker threads sharing one encoder for gigatoken (it releases the GIL); worker
        processes each loading the tokenizer for the reference libraries. Returns the
        executor and the task to submit: task(chunk, part prefixes) -> the chunk's summary."""
        cfg = self.cfg
        encoder, note = load_encoder(self.tokenizer, cfg.tokenizer_backend)
        if note:
            self._say(f"note: {note}")
        self.encoder = encoder
        settings = WorkerSettings(cfg.tokenizer_type, cfg.tokenizer_model, encoder.name,
                                  tuple(self.keys), self.tokenizer.eod if cfg.append_eod else None,
                                  self.tokenizer.bos if cfg.prepend_bos else None,
                                  cfg.on_error == "fail", np.dtype(self.dtype).name)
        if isinstance(encoder, GigatokenEncoder):
            self.counters = ThreadCounters()
            return ThreadPoolExecutor(cfg.workers), ChunkTokenizer(settings, encoder, self.counters)
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        ctx = multiprocessing.get_context("spawn")  # no forked copies of our threads or state
        self.counters = ctx.Array("q", 2)
        return ProcessPoolExecutor(cfg.workers, ctx, init_worker, (settings, self.counters)), work

    def _verify(self, chunk: Chunk) -> None:
        """gigatoken's ids on the first documents of the run must be the reference's.
        Each document is cut to its first `_VERIFY_CHARS` characters (both tokenizers see
        the same text), so that the reference library's time stays small."""
        records = []
        for record in iter_records(chunk, self.keys):
            if not isinstance(record, Skip):
                records.append([text[:_VERIFY_CHARS] for text in record])
                if len(records) == self.cfg.verify_docs:
                    break
        reference = ReferenceEncoder(self.tokenizer)
        for i, key in enumerate(self.keys):
            texts = [r[i] for r in records]
            diff = first_difference(self.encoder, reference, texts)
            if diff is not None:
                doc, token, ours, theirs = diff
                raise UserError(
                    f"--verify-tokenizer: gigatoken's ids differ from the reference "
                    f"library's for {self.tokenizer.path} on {key!r} of document {doc + 1} "
                    f"of {chunk.shard.path} chunk {chunk.index} at token {token} "
                    f"({ours} vs {theirs}); rerun with --tokenizer-backend reference")

    def _process(self, shards: list) -> None:
        cfg = self.cfg
        progress = Progress(self.log, sum(s.size for s in shards), cfg.log_interval)
        executor, task = self._executor()
        # gigatoken's ids are checked on the run's first chunk once every worker has a
        # chunk, so that the check (the reference library's time) holds up no worker, and
        # before any chunk is recorded: what was tokenized unchecked is never kept.
        unverified = isinstance(self.encoder, GigatokenEncoder) and cfg.verify_docs > 0
        first = None  # the run's first chunk
        inflight = {}
        try:
            for shard in shards:
                state = self._open_shard(shard, progress)
                if state is None:
                    continue
                chunk_bytes = cfg.chunk_bytes or auto_chunk_bytes(shard)
                for item in read_chunks(shard, self.keys, chunk_bytes):
                    if isinstance(item, Skip):
                        self._skip(state, item, progress)
                        continue
                    state.chunks += 1
                    manifest = read_json(self._chunk_json(state.dir, item.index))
                    if manifest is not None:  # finished by an earlier run
                        self._check_reused(shard, (manifest["errors"] or [None])[0])
                        progress.resumed(item.disk_bytes)
                        self.run_stats["chunks_resumed"] += 1
                        continue
                    # Bounded read-ahead: at most two chunks of text per worker in memory.
                    while len(inflight) >= 2 * cfg.workers:
                        self._collect(inflight, progress, timeout=0.25)
                    prefixes = self._part_prefixes(state.dir, item.index)
                    inflight[executor.submit(task, item, prefixes)] = (state, item)
                    state.pending += 1
                    first = first or item
                    if unverified and len(inflight) < cfg.workers:
                        continue
                    if unverified:
                        self._verify(first)
                        unverified = False
                    self._collect(inflight, progress, timeout=0)
                state.read = True
                self._close_shard(state)
            if unverified and first is not None:  # fewer chunks than workers
                self._verify(first)
                unverified = False
            while inflight:
                self._collect(inflight, progress, timeout=0.25)
        except BrokenExecutor as e:  # a BrokenProcessPool: threads cannot die alone
            raise RuntimeError("a worker process died (killed, or out of memory?); "
                               "rerun the same command to resume") from e
        finally:
            # On any way out (an error, Ctrl-C, SIGTERM), running chunks finish and are
            # recorded, so that the next run need not redo them.
            executor.shutdown(wait=True, cancel_futures=True)
            for future, (state, chunk) in inflight.items():
                if future.cancelled() or future.exception() is not None:
                    continue
                if unverified:
                    self._discard(state, chunk)
                else:
                    self._record(state, chunk, future.result(), progress)
            progress.close()

    def _open_shard(self, shard: Shard, progress: Progress) -> Optional[_ShardState]:
        done = self._finished(shard)
        if done is not None:
            self._check_reused(shard, done["first_error"])
            progress.resumed(shard.size)
            self.run_stats["shards_resumed"] += 1
            return None
        state = _ShardState(shard, self._shard_dir(shard))
        source_path = os.path.join(state.dir, "source.json")
        if read_json(source_path) != self._source(shard):
            # Parts made from another version of the file or other settings are stale.
            shutil.rmtree(state.dir, ignore_errors=True)
            os.makedirs(state.dir)
            write_json(source_path, self._source(shard))
        return state

    def _skip(self, state: _ShardState, skip: Skip, progress: Progress) -> None:
        if self.cfg.on_error == "fail":
            raise BadRecord(fail_message(skip, state.shard.path))
        state.errors.append([skip.line, skip.reason, skip.detail, skip.count])
        self._live_error(state.shard.path, state.errors[-1], progress)

    def _live_error(self, path: str, error: list, progress: Progress) -> None:
        self.live_errors += 1
        if self.live_errors <= _LIVE_ERRORS:
            progress.message("skipped " + Skip(*error).describe(path))
        if self.live_errors == _LIVE_ERRORS:
            progress.message(f"(further skipped records: see {self.cfg.errors_path} at the end)")

    def _collect(self, inflight: dict, progress: Progress, timeout: float) -> None:
        done, _ = wait(list(inflight), timeout=timeout, return_when=FIRST_COMPLETED)
        failure = None
        for future in done:
            if future.exception() is not None:
                failure = failure or future.exception()
                state = inflight.pop(future)[0]
                state.pending -= 1
                state.failed = True
            else:
                self._record(*inflight.pop(future), future.result(), progress)
        if failure is not None:
            raise failure
        progress.docs, progress.tokens = self.counters[0], self.counters[1]
        progress.tick()

    def _record(self, state: _ShardState, chunk: Chunk, summary: dict, progress: Progress):
        """A finished chunk: its manifest marks its parts complete.

        The parts are synced to disk here, not by the workers, so that no worker waits on
        the disk with a CPU idle (this thread mostly waits anyway)."""
        for prefix in self._part_prefixes(state.dir, chunk.index).values():
            sync(prefix)
        write_json(self._chunk_json(state.dir, chunk.index), summary)
        state.pending -= 1
        progress.add(input_bytes=chunk.input_bytes, disk_bytes=chunk.disk_bytes)
        self.run_stats.update(chunks_processed=1, documents=summary["documents"],
                              tokens=sum(summary["tokens"].values()),
                              input_bytes=chunk.input_bytes)
        for error in summary["errors"]:
            self._live_error(state.shard.path, error, progress)
        self._close_shard(state)

    def _discard(self, state: _ShardState, chunk: Chunk) -> None:
        """A finished chunk that is not to be kept: its parts are removed."""
        for prefix in self._part_prefixes(state.dir, chunk.index).values():
            for path in (bin_path(prefix), idx_path(prefix)):
                if os.path.exists(path):
                    os.remove(path)

    def _close_shard(self, state: _ShardState) -> None:
        """Once all its chunks are finished, mark the shard done with its totals."""
        if not state.read or state.pending or state.failed:
            return
        totals = _Totals(self.keys)
        totals.add_errors(state.errors)
        for i in range(state.chunks):
            totals.add_chunk(read_json(self._chunk_json(state.dir, i)))
        write_json(os.path.join(state.dir, "done.json"),
                     {"source": self._source(state.shard), "chunks": state.chunks,
                      "shard_errors": state.errors, "first_error": totals.first_error,
                      **totals.as_dict()})

    # -- the end

    def _group_stats(self, seconds: float, records: Optional[dict]) -> dict:
        cfg = self.cfg
        if records is None:
            self._say(f"group {cfg.group_index} of {cfg.num_groups} finished; once every group "
                      "has, run the same command with --merge-only to merge them")
        else:
            self._say(f"group {cfg.group_index} of {cfg.num_groups} finished: its prefixes are "
                      "usable now; once every group has, run the same command with "
                      f"--merge-only to write {MANIFEST}")
        stats = {"group": [cfg.group_index, cfg.num_groups], "seconds": round(seconds, 3),
                 "this_run": self._run_dict(seconds)}
        if records is not None:
            stats["prefixes"] = self._prefix_paths(records)
        return stats

    def _prefix_paths(self, records: dict) -> dict:
        """key -> [{prefix (a path), documents, tokens, max_token_id}] of a prefix set's
        records."""
        return {k: [{"prefix": os.path.join(self.cfg.output(k), p["name"]),
                     "documents": p["documents"], "tokens": p["tokens"],
                     "max_token_id": p.get("max_token_id")}
                    for p in records[k]["prefixes"]] for k in self.keys}

    def _run_dict(self, seconds: float) -> dict:
        r = self.run_stats
        rate = lambda n: round(n / seconds, 1) if seconds > 0 else 0.0  # noqa: E731
        return {"documents": r["documents"], "tokens": r["tokens"],
                "input_bytes": r["input_bytes"], "chunks_processed": r["chunks_processed"],
                "chunks_resumed": r["chunks_resumed"], "shards_resumed": r["shards_resumed"],
                "groups_resumed": r["groups_resumed"],
                "docs_per_s": rate(r["documents"]), "tokens_per_s": rate(r["tokens"]),
                "mb_per_s": round(r["input_bytes"] / 1e6 / seconds, 3) if seconds > 0 else 0.0,
                "tokenizer_backend": self.encoder.name if self.encoder else None}

    def _up_to_date(self) -> Optional[dict]:
        stats = read_json(self.cfg.stats_path)
        if stats is None or stats.get("identity") != self.identity:
            return None
        for path, size in stats.get("output_files", {}).items():
            if not os.path.isfile(path) or os.path.getsize(path) != size:
                return None
        if self.cfg.on_error == "fail" and stats["first_errors"]:
            raise BadRecord(stats["first_errors"][0] + " (--on-error fail)")
        return stats

    def _all_finished(self, shards: list) -> list:
        """The shards' `done.json`s; all must be there."""
        dones = [self._finished(s) for s in shards]
        missing = [s for s, d in zip(shards, dones) if d is None]
        if missing:
            raise UserError(f"{len(missing)} of {len(shards)} input files are not "
                            f"processed yet, e.g. {missing[0].path}: run every preprocessing "
                            "task to the end before --merge-only")
        return dones

    def _totals(self, shards: list, dones: list, errors_path: str) -> dict:
        """What the stats say about these shards; writes their skipped records to
        `errors_path`."""
        totals = _Totals(self.keys)
        for done in dones:
            totals.add_chunk(done)
        first_errors = _write_lines(errors_path, self._error_lines(shards, dones))
        return {**totals.as_dict(), "input_disk_bytes": sum(s.size for s in shards),
                "shards": len(shards), "chunks": sum(d["chunks"] for d in dones),
                "errors_log": errors_path if first_errors else None,
                "first_errors": first_errors}

    def _finalize_single(self, seconds: float) -> dict:
        """--single-prefix: every part merged, resumably, into one prefix per key."""
        cfg = self.cfg
        dones = self._all_finished(self.shards)
        totals = self._totals(self.shards, dones, cfg.errors_path)
        for key in self.keys:
            parts = [self._part_prefixes(self._shard_dir(s), i)[key]
                     for s, d in zip(self.shards, dones) for i in range(d["chunks"])]
            merge_resumable(parts, cfg.output(key), self.dtype)
        prefixes = {k: [{"prefix": cfg.output(k), "documents": totals["documents"],
                         "tokens": totals["tokens"][k]}] for k in self.keys}
        files = [p for k in self.keys for p in (bin_path(cfg.output(k)), idx_path(cfg.output(k)))]
        return self._write_stats(seconds, totals, prefixes, files)

    def _finalize_set(self, seconds: float) -> dict:
        """Every group's prefixes listed in each key's manifest.json; nothing is copied."""
        cfg = self.cfg
        writers = [self._group_writer(g, self._group_shards(g)) for g in range(self.num_groups)]
        records = [w.done() for w in writers]
        missing = [g for g, r in enumerate(records) if r is None]
        if missing:
            path = os.path.join(cfg.output(self.keys[0]), group_file(missing[0], self.num_groups))
            why = ("is from other inputs or settings (--merge-only takes the tasks' flags), "
                   "or a prefix it lists is gone" if os.path.exists(path) else "is missing")
            raise UserError(f"{len(missing)} of {self.num_groups} groups are not finished, e.g. "
                            f"group {missing[0]}: {path} {why}; run every preprocessing task "
                            "to the end before --merge-only")
        listed = {k: [p for r in records for p in r[k]["prefixes"]] for k in self.keys}
        files = []
        for key in self.keys:
            folder = cfg.output(key)
            manifest = set_record(self.header, listed[key])
            write_json(os.path.join(folder, MANIFEST), manifest)
            remove_unlisted(folder, manifest, self.num_groups)
            files += [os.path.join(folder, MANIFEST)] + [
                path for p in manifest["prefixes"]
                for path in (bin_path(os.path.join(folder, p["name"])),
                             idx_path(os.path.join(folder, p["name"])))]
        groups = [r[self.keys[0]]["stats"] for r in records]
        totals = _sum_totals(groups, self.keys)
        logs = [g["errors_log"] for g in groups if g["errors_log"]]
        if logs != [cfg.errors_path]:  # a run without groups wrote it already
            totals["first_errors"] = _write_lines(cfg.errors_path, _lines_of(logs))
        totals["errors_log"] = cfg.errors_path if totals["first_errors"] else None
        prefixes = self._prefix_paths({k: {"prefixes": listed[k]} for k in self.keys})
        return self._write_stats(seconds, totals, prefixes, files)

    def _write_stats(self, seconds: float, totals: dict, prefixes: dict, files: list) -> dict:
        cfg = self.cfg
        stats = {"outputs": {k: cfg.output(k) for k in self.keys},
                 "layout": "single-prefix" if cfg.single_prefix else "prefix-set",
                 "prefixes": prefixes, **totals, "tokens_by_key": totals["tokens"],
                 "seconds": round(seconds, 3), "workers": cfg.workers,
                 "this_run": self._run_dict(seconds),
                 "tokenizer": self.tokenizer.unique_identifiers, "dtype": self.settings["dtype"],
                 "json_keys": self.keys, "append_eod": cfg.append_eod,
                 "prepend_bos": cfg.prepend_bos, "identity": self.identity,
                 "output_files": {path: os.path.getsize(path) for path in files},
                 "max_token_id": self._max_ids(prefixes)}
        stats["tokens"] = sum(stats["tokens_by_key"].values())
        write_json(cfg.stats_path, stats)
        if not cfg.keep_parts:
            shutil.rmtree(cfg.parts_dir, ignore_errors=True)
        return stats

    def _error_lines(self, shards: list, dones: list):
        """Every skipped record of the shards, in input order, as `file:line: reason:
        detail`."""
        for shard, done in zip(shards, dones):
            if not done["skipped"]:
                continue
            errors = list(done["shard_errors"])
            for chunk in self._chunks(shard, done):
                errors += chunk["errors"]
            for error in sorted(errors, key=lambda e: e[0]):
                yield Skip(*error).describe(shard.path)


    def _max_ids(self, prefixes: dict) -> dict:
        """Each key's largest id, every id of every output read once (the full check the
        trainer only samples: data/checks.py): --single-prefix's output here; a prefix set's
        by the task that wrote each prefix (`GroupWriter`, in its manifest entry), so that the
        step listing them reads no corpus (None for a key whose group files, of an earlier
        version, record none)."""
        if self.cfg.single_prefix:
            return {k: self._checked_max_id(p["prefix"], max_token_id(p["prefix"]))
                    for k, ps in prefixes.items() for p in ps}
        tops = {k: [self._checked_max_id(p["prefix"], p["max_token_id"]) for p in ps
                    if p["max_token_id"] is not None] for k, ps in prefixes.items()}
        return {k: max(tops[k], default=-1) if len(tops[k]) == len(ps) else None
                for k, ps in prefixes.items()}

    def _checked_max_id(self, prefix: str, top: int) -> int:
        """`top`, the largest id of `prefix`, below the tokenizer's vocabulary, or the output
        is refused."""
        if top >= self.tokenizer.vocab_size:
            raise UserError(f"token id {top} in {bin_path(prefix)} is >= the tokenizer's "
                            f"vocab_size {self.tokenizer.vocab_size}")
        return top

def _remove_parts(parts: list) -> None:
    """Token files of parts merged into a finished prefix (their chunks' records stay)."""
    for part in parts:
        for prefix in part.prefixes.values():
            for path in (bin_path(prefix), idx_path(prefix)):
                if os.path.exists(path):
                    os.remove(path)


def _write_lines(path: str, lines) -> list:
    """Write `lines` to `path` (atomically; no file, and none left from an earlier run,
    when there are none); returns the first 20."""
    tmp = f"{path}.tmp{os.getpid()}"
    first = []
    with open(tmp, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(line + "\n")
            if len(first) < 20:
                first.append(line)
    if first:
        os.replace(tmp, path)
    else:
        os.remove(tmp)
        if os.path.exists(path):  # from an earlier run of other inputs
            os.remove(path)
    return first


def _lines_of(paths: list):
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                yield line.rstrip("\n")


def _sum_totals(groups: list, keys: Sequence[str]) -> dict:
    """The groups' stats added up."""
    tokens, skipped = Counter({k: 0 for k in keys}), Counter()
    for g in groups:
        tokens.update(g["tokens"])
        skipped.update(g["skipped"])
    total = {field: sum(g[field] for g in groups)
             for field in ("documents", "input_bytes", "input_disk_bytes", "shards", "chunks")}
    return {**total, "tokens": dict(tokens),
            "skipped": {r: skipped[r] for r in SKIP_REASONS if skipped[r]},
            "first_errors": [e for g in groups for e in g["first_errors"]][:20]}


class _Totals:
    """Documents, tokens, bytes and skips added up over chunks (or shards)."""

    def __init__(self, keys: Sequence[str]):
        self.documents = self.input_bytes = 0
        self.tokens = Counter({k: 0 for k in keys})
        self.skipped = Counter()
        self.first_error = None

    def add_errors(self, errors: list) -> None:
        for line, reason, detail, count in errors:
            self.skipped[reason] += count
        if errors and self.first_error is None:
            self.first_error = errors[0]

    def add_chunk(self, summary: dict) -> None:
        self.documents += summary["documents"]
        self.input_bytes += summary["input_bytes"]
        self.tokens.update(summary["tokens"])
        self.skipped.update(summary["skipped"])
        first = summary.get("first_error") or (summary.get("errors") or [None])[0]
        self.first_error = self.first_error or first

    def as_dict(self) -> dict:
        return {"documents": self.documents, "tokens": dict(self.tokens),
                "input_bytes": self.input_bytes,
                "skipped": {r: self.skipped[r] for r in SKIP_REASONS if self.skipped[r]}}


def format_summary(stats: dict) -> str:
    """The stats as a few lines for people."""
    run = stats["this_run"]
    lines = []
    if "group" in stats and "prefixes" in stats:
        g, n = stats["group"]
        for key, prefixes in stats["prefixes"].items():
            lines.append(f"group {g} of {n}: wrote {len(prefixes)} prefix(es) of {key!r}")
    if "outputs" in stats:
        for key, output in stats["outputs"].items():
            if stats["layout"] == "single-prefix":
                lines.append(f"wrote {output}.bin/.idx ({stats['dtype']})")
            else:
                lines.append(f"wrote {output}/{MANIFEST}: {len(stats['prefixes'][key])} "
                             f"prefix(es) ({stats['dtype']})")
        skipped = stats["skipped"]
        lines.append(f"{stats['documents']:,} documents, {stats['tokens']:,} tokens from "
                     f"{stats['shards']} file(s); skipped {sum(skipped.values()):,}"
                     + (f" ({', '.join(f'{r}: {n:,}' for r, n in skipped.items())})"
                        if skipped else ""))
        if stats["errors_log"]:
            lines.append(f"skipped records are listed in {stats['errors_log']}")
    if stats.get("up_to_date"):
        lines.append("nothing to do: the outputs are up to date with the inputs")
        return "\n".join(lines)
    resumed = (f"; reused {run['chunks_resumed']} chunk(s) and {run['shards_resumed']} "
               "file(s) from an earlier run" if run["chunks_resumed"] or run["shards_resumed"]
               else "")
    if run["chunks_processed"]:
        lines.append(f"this run: {run['documents']:,} docs in {stats['seconds']:.1f} s "
                     f"({run['docs_per_s']:,.0f} docs/s, {run['tokens_per_s']:,.0f} tokens/s, "
                     f"{run['mb_per_s']:.2f} MB/s, {run['tokenizer_backend']}){resumed}")
    else:
        lines.append(f"this run: nothing left to tokenize{resumed}; {stats['seconds']:.1f} s")
    return "\n".join(lines)


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()
