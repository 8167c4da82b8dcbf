"""Host-resident STEM tables: each micro-batch's rows staged one micro-batch ahead.

With `tables.placement: host` the tables live in host memory (one copy per node,
`model/host_copy.py`), and the accelerator only ever holds the rows a micro-batch needs:

1. The trainer hands the store the micro-batches of a step, in order (`stage`). A
   micro-batch's token ids are known before it runs, so a background worker computes its
   unique ids, gathers their rows from the host tables into a staging buffer (several
   threads: `index_select` releases the GIL) and copies them to the accelerator (on a GPU:
   pinned buffer, non-blocking copy on a side stream, an event the compute stream waits
   on). Two staging buffers alternate, so the gather of micro-batch i+1 overlaps the copy
   of micro-batch i; the staging of i+1 starts when the forward of i asks for its rows,
   so exactly one micro-batch is staged ahead (bounded accelerator memory).
2. A forward's `StemTable` asks for its rows with the token ids it received through the
   model's id seam (`lookup`: the store is the table's `RowSource`, model/table.py). The
   staged micro-batch is found by the ids tensor's storage (the storage object and the
   offset in it: the same for a view or a detached copy, never a reused address), not by
   a "current micro-batch" pointer: activation recompute replays the forward with the
   same ids tensor, so it finds the same staged rows (and so would a pipeline schedule
   that runs forward k+1 before backward k).
3. A micro-batch's staged rows are, per table, a leaf tensor [unique ids, width] that
   requires grad; the lookup is `embedding(inverse, rows, sparse=True)`. A backward's
   gradient of them (one value per position) goes to the table's `RowGradSum`, which sums
   it per row exactly as device-placed tables' gradients are summed
   (tables/row_grads.py): `take_row_grads` hands out the step's sums. No [V, w] buffer.
4. Hot rows come from a cache on the accelerator (`RowCache`, LFU with aging): only
   misses are gathered and copied.

Ordering guarantee (an update must land before its row is staged again):
* The table optimizer writes the host tables only in `TableOptimizer.step()` (and when a
  checkpoint is loaded, before anything is staged).
* `stage()` for the next step is refused between `take_row_grads()` (the step's gradients
  were taken) and `rows_changed()`, which `TableOptimizer.step()` calls after every owner
  of a shared copy has written its rows (a barrier over the copy's ranks).
* The worker only runs what `stage()` and `rows_changed()` queued, in order, on one
  thread (and one CUDA stream): the cache refresh after step k runs before the first
  gather of step k+1, and nothing reads a table while `step()` writes it (`step()` first
  waits until the worker is idle).
So every micro-batch of step k+1 sees every update of step k, and no micro-batch of step
k sees an update of step k (gradient accumulation reads one version of the tables).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Optional

import torch

from megatron_stem.model.host_copy import HostCopy
from megatron_stem.model.row_cache import RowCache
from megatron_stem.tables.row_gather import StagingBuffer, gather_rows
from megatron_stem.tables.row_grads import RowGradSum, host_tokens, take_same_rows


def _key(tokens: torch.Tensor) -> tuple[torch.UntypedStorage, int]:
    """What finds a micro-batch's staged rows: its ids' storage and their offset in it."""
    return tokens.untyped_storage(), tokens.storage_offset()


@dataclass
class _Staged:
    """One micro-batch on the device: its sorted unique ids (CPU), the position of each
    token's id among them (device, the ids' shape), and per table the rows (leaves)."""

    ids: torch.Tensor
    inverse: torch.Tensor
    rows: list[torch.Tensor]
    ready: Optional[torch.cuda.Event] = None


@dataclass(eq=False)
class _Entry:
    tokens: torch.Tensor  # the micro-batch's ids as given to the model (kept alive with
    # the storage that keys the entry)
    ids: torch.Tensor  # the same on the CPU
    requires_grad: bool
    position: int  # in the step's order
    future: Optional[Future] = None
    staged: Optional[_Staged] = None


@dataclass
class _Stats:
    wait_s: float = 0.0  # time forwards waited for staged rows
    h2d_bytes: int = 0  # rows copied to the device (misses and cache refreshes)
    unique: int = 0  # unique ids of training micro-batches ...
    hits: int = 0  # ... of them served by the cache
    tokens: int = 0
    token_hits: int = 0
    steps: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, **values) -> None:
        with self.lock:
            for k, v in values.items():
                setattr(self, k, getattr(self, k) + v)

    def take(self) -> dict:
        """The counters, reset to zero."""
        with self.lock:
            out = {k: getattr(self, k) for k in _COUNTERS}
            for k in _COUNTERS:
                setattr(self, k, type(out[k])(0))
        return out


_COUNTERS = tuple(f.name for f in fields(_Stats) if f.name != "lock")


class HostTableStore:
    """Stages the rows of host-resident STEM tables for the model's forwards (see the
    module docstring for the pipeline and the ordering guarantee).

    `tables`: the model's host-placed `StemTable`s (all of one width, sharing the token
    ids); `dtype`: the compute dtype rows are staged in; `cache_rows`: hot-row cache size
    (0 = none); `lookahead`: micro-batches staged ahead of the one computing (0 = stage
    on demand, no overlap: for measurements).
    """

    def __init__(self, tables: list, device: torch.device, dtype: torch.dtype,
                 cache_rows: int = 0, gather_threads: int = 4, lookahead: int = 1,
                 cache_decay: float = 0.99):
        self.modules = list(tables)
        self.hosts = [m.weight.data for m in self.modules]
        self.index = {id(m): i for i, m in enumerate(self.modules)}
        self.copy = getattr(self.modules[0], "host_copy", None) or HostCopy.alone()
        widths = {h.shape[1] for h in self.hosts}
        if len(widths) != 1:
            raise ValueError(f"host tables of different widths {sorted(widths)}")
        self.vocab, self.width = self.hosts[0].shape
        self.device, self.dtype, self.lookahead = torch.device(device), dtype, lookahead
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        init = (lambda: torch.cuda.set_device(self.device)) if self.cuda else None
        self.worker = ThreadPoolExecutor(1, "stem-stage", initializer=init)
        self.pool = ThreadPoolExecutor(gather_threads, "stem-gather") \
            if gather_threads > 1 else None
        self.buffers = [StagingBuffer(self.cuda) for _ in range(lookahead + 1)]
        self._next_buffer = 0
        self.cache = RowCache(self.vocab, cache_rows, [self.width] * len(self.hosts), dtype,
                              [self.device] * len(self.hosts), cache_decay) \
            if cache_rows else None
        if self.cuda:  # the cache was zero-filled on the compute stream; all else is here
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self.stats = _Stats()
        self.row_grads = [RowGradSum(self.width, dtype, self.device) for _ in self.hosts]
        self._entries: list[_Entry] = []
        self._by_key: dict[tuple, _Entry] = {}
        self._submitted = 0
        self._grads_taken = False
        for m in self.modules:
            m.host = self

    # -- the trainer's side ---------------------------------------------------------------

    def stage(self, microbatches: list[dict], requires_grad: bool = True) -> None:
        """Take the micro-batches about to run (in order); start staging the first."""
        if self._grads_taken:
            raise RuntimeError(
                "stage(): the last step's row gradients were taken but not yet applied "
                "(TableOptimizer.step): its updates must land before the next micro-batches' "
                "rows are gathered")
        self.wait_idle()
        self._entries, self._by_key, self._submitted = [], {}, 0
        for mb in microbatches:
            tokens = mb["tokens"]
            if _key(tokens) not in self._by_key:  # the same tensor twice: one staging
                # The loader's host copy, or to the CPU here, on the compute stream that
                # produced the ids (the worker's stream does not wait for it).
                entry = _Entry(tokens, host_tokens(mb).to(torch.long), requires_grad,
                               len(self._entries))
                self._by_key[_key(tokens)] = entry
                self._entries.append(entry)
        self._submit_through(self.lookahead - 1)

    def take_row_grads(self) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """The step's row gradients: the sorted ids of the rows backwards reached and, per
        table, their summed gradients [rows, width] (in the staging dtype; both on the
        device; tables/row_grads.py), and whether every lookup read staged rows (a device
        bool). Releases the staged rows."""
        self._entries, self._by_key = [], {}
        self._grads_taken = True
        self.stats.add(steps=1)
        return take_same_rows(self.row_grads)

    def rows_changed(self, rows: Optional[torch.Tensor]) -> None:
        """The table optimizer has written `rows` (None: every row) of every table, and
        every writer is done. Refreshes the cached copies of those rows before anything
        else is staged."""
        self._grads_taken = False
        if self.cache is not None:
            self._submit(self._refresh, None if rows is None else rows.cpu())

    def wait_idle(self) -> None:
        """Wait for all queued staging and refreshes."""
        for e in self._entries:
            if e.future is not None:
                e.future.result()
        self.worker.submit(lambda: None).result()

    def invalidate(self) -> None:
        """The tables were rewritten wholesale (a checkpoint was loaded): drop the cache."""
        self.wait_idle()
        if self.cache is not None:
            self.cache.clear()

    def take_stats(self) -> dict[str, float]:
        """Per-step averages since the last call: prefetch wait, bytes copied to the
        device, cache hit rates (over unique ids, and over tokens)."""
        s = self.stats.take()
        steps = max(s["steps"], 1)
        out = {"prefetch_wait_ms": s["wait_s"] * 1e3 / steps, "h2d_bytes": s["h2d_bytes"] / steps}
        if self.cache is not None:
            out["cache_hit_rate"] = s["hits"] / max(s["unique"], 1)
            out["cache_token_hit_rate"] = s["token_hits"] / max(s["tokens"], 1)
        return out

    def close(self) -> None:
        self.worker.shutdown(wait=True)
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        for m in self.modules:
            m.host = None

    # -- the model's side -----------------------------------------------------------------

    def lookup(self, token_ids: torch.Tensor, module) -> tuple[torch.Tensor, torch.Tensor]:
        """(inverse ids shaped like `token_ids`, staged rows of `module`'s table): the
        `RowSource` protocol of model/table.py."""
        entry = self._by_key.get(_key(token_ids))
        if entry is None:
            raise RuntimeError(
                "host-resident STEM table: no staged rows for these token ids; every "
                "micro-batch must be handed to TableOptimizer.stage() before its forward "
                "(stem_ids remaps are not supported with tables.placement: host)")
        if entry.staged is None:
            self._consume(entry)
        staged = entry.staged
        inverse = staged.inverse
        if token_ids.shape != inverse.shape:
            if token_ids.shape != inverse.t().shape:
                raise RuntimeError(f"token ids of shape {tuple(token_ids.shape)} for a staged "
                                   f"micro-batch of shape {tuple(inverse.shape)}")
            inverse = inverse.t()
        return inverse, staged.rows[self.index[id(module)]]

    def _consume(self, entry: _Entry) -> None:
        self._submit_through(entry.position + self.lookahead)  # the next one starts now
        start = time.perf_counter()
        staged = entry.future.result()
        self.stats.add(wait_s=time.perf_counter() - start)
        if self.cuda:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(staged.ready)
            for t in (staged.inverse, *staged.rows):  # allocated on the side stream
                t.record_stream(compute)
        entry.staged = staged

    # -- the worker -----------------------------------------------------------------------

    def _submit(self, fn, *args) -> Future:
        return self.worker.submit(fn, *args)

    def _submit_through(self, position: int) -> None:
        while self._submitted <= min(position, len(self._entries) - 1):
            entry = self._entries[self._submitted]
            entry.future = self._submit(self._stage_one, entry.ids, entry.requires_grad)
            self._submitted += 1

    def _buffer(self) -> StagingBuffer:
        buf = self.buffers[self._next_buffer]
        self._next_buffer = (self._next_buffer + 1) % len(self.buffers)
        return buf

    def _to_device(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of every table, [tables, len(ids), width] on the device (in flight
        on the side stream when it is a GPU)."""
        buf = self._buffer()
        staging = buf.take((len(self.hosts), ids.numel(), self.width), self.dtype)
        for host, out in zip(self.hosts, staging):
            gather_rows(host, ids, out, self.pool)
        self.stats.add(h2d_bytes=staging.numel() * staging.element_size())
        if not self.cuda:
            return staging.clone()  # the CPU stand-in for the copy to the device
        rows = staging.to(self.device, non_blocking=True)
        buf.copied = torch.cuda.Event()
        buf.copied.record(self.stream)
        return rows

    def _on_side_stream(self):
        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

    def _stage_one(self, token_ids: torch.Tensor, requires_grad: bool) -> _Staged:
        with self._on_side_stream():
            ids, where = torch.unique(token_ids, return_inverse=True)
            inverse = where.to(self.device, non_blocking=True)
            if self.cache is None:
                fetched = self._to_device(ids)
                rows = [self._leaf(t, r, ids, requires_grad)
                        for t, r in enumerate(fetched.unbind(0))]
                return self._done(_Staged(ids, inverse, rows))
            slots = self.cache.slots(ids)
            hit = slots >= 0
            fetched = self._to_device(ids[~hit])
            hit_at, miss_at = (x.nonzero().flatten().to(self.device, non_blocking=True)
                               for x in (hit, ~hit))
            hit_slots = slots[hit].to(self.device, non_blocking=True)
            rows = [self._leaf(t, self.cache.assemble(t, hit_at, hit_slots, miss_at, missed),
                               ids, requires_grad)
                    for t, missed in enumerate(fetched.unbind(0))]
            if requires_grad:
                self.cache.observe(ids)
                counts = torch.bincount(where.flatten(), minlength=ids.numel())
                self.stats.add(unique=ids.numel(), hits=int(hit.sum()),
                               tokens=where.numel(), token_hits=int(counts[hit].sum()))
            return self._done(_Staged(ids, inverse, rows))

    def _leaf(self, table: int, rows: torch.Tensor, ids: torch.Tensor,
              requires_grad: bool) -> torch.Tensor:
        """Staged `rows` (table rows `ids`) of table `table`, as a leaf whose gradient, if
        it gets one, goes to the table's `RowGradSum`."""
        if requires_grad:
            rows.requires_grad_()
            rows.register_post_accumulate_grad_hook(
                functools.partial(self.row_grads[table].hook, row_ids=ids))
        return rows

    def _done(self, staged: _Staged) -> _Staged:
        if self.cuda:
            staged.ready = torch.cuda.Event()
            staged.ready.record(self.stream)
        return staged

    def _refresh(self, changed: Optional[torch.Tensor]) -> None:
        """Admit/evict by frequency, then rewrite the cached rows that changed or are new."""
        with self._on_side_stream():
            admitted = self.cache.plan()
            occupied = self.cache.occupied()
            if changed is None:
                stale = occupied
            else:
                slots = self.cache.slots(changed)
                stale = slots[slots >= 0]
            slots = torch.unique(torch.cat([admitted, stale]))
            if slots.numel():
                fetched = self._to_device(self.cache.id_of[slots])
                for t, rows in enumerate(fetched.unbind(0)):
                    self.cache.write(t, slots, rows)

