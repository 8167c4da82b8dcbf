"""The STEM tables' optimizer, ZeRO-Offload style, outside the DeepSpeed engine.

Why outside: DeepSpeed's ZeRO cannot take sparse gradients, and a dense gradient of all
tables (21 GB fp32 at 1B) per step would cost more than the whole backbone. So the model's
table parameters produce row-sparse gradients (`StemTable.sparse_grad`): only the rows of
the micro-batches' token ids, summed per row the same way for every placement
(tables/row_grads.py). Each step (in this order: training/update.py):

1. `sync_grads`: each table's row gradients averaged over data parallel onto the ranks
   that update the rows (the partition's way, partition.py), and each row's sum of
   squares taken for the norm while the gradients are still on the accelerator;
2. `grad_norm_sq`: the tables' share of the global gradient norm;
3. `step(lr, clip_coef)`: AdamW on the rows this rank owns, where the fp32 master and
   moments live (CPU memory, DeepSpeed's CPU Adam arithmetic updating the rows in place;
   or the accelerator), then the updated rows to every holder of the table
   (`tables.overlap: next_step`: in the background, overlap.py).

Update semantics (`optimizer.tables.update`):
* `dense`: AdamW on every row every step, untouched rows with a zero gradient (the
  paper's reference code): momentum and weight decay keep moving unseen rows.
* `lazy`: Adam on the touched rows only (torch `SparseAdam` semantics: a row's moments
  change only when it is touched, bias correction follows the global step; decoupled
  weight decay applies to touched rows). Cost follows touched rows, not vocabulary.
"""

from __future__ import annotations

import itertools
from typing import Optional

import torch

from megatron_stem.config.table_layout import TableLayout
from megatron_stem.runtime import parallel
from megatron_stem.runtime.host_read import HostRead
from megatron_stem.tables.adam import AdamKernel
from megatron_stem.tables.comm import Comm, Devices, HostStaging, tracked
from megatron_stem.tables.overlap import READY_STAGES, STAGE_NAMES, Job, Overlap
from megatron_stem.tables.partition import (
    Partition,
    Replicated,
    RowSharded,
    SharedHostCopy,
    TableState,
)
from megatron_stem.tables.row_grads import (
    LOOKED_UP_OTHERS,
    StepRows,
    host_tokens,
    row_grads_of,
    table_row_grads,
    take_same_rows,
)
from megatron_stem.tables.shards import TrafficCounters, earliest, positions_in
from megatron_stem.tables.states import checkpoint_states, load_states
from megatron_stem.tables.streams import side_streams

DENSE_CHUNK_BYTES = 64 << 20  # `dense` updates this many bytes of fp32 rows at a time


def _partition(layout: TableLayout, vocab: int, devices: Devices, dp_group,
               host) -> Partition:
    """The partition class of `layout`, picked once."""
    dp = Comm(dp_group, devices, "the data-parallel group")
    if not layout.on_host:
        if layout.sharded:
            return RowSharded(vocab, devices, not layout.state_on_accelerator, dp, dp)
        return Replicated(vocab, devices, True, dp)
    copy = host.copy

    def comm(group, name):
        return Comm(group, devices, name) if group is not None else Comm.alone(devices, name)
    cross = comm(copy.cross_group, "the host copies' peers")
    if layout.sharded:
        return RowSharded(vocab, devices, True, dp, cross, copy)
    return SharedHostCopy(vocab, devices, dp, copy, comm(copy.group, "a host copy's ranks"),
                          cross)


def all_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Whether every element is finite, as a device bool (no sync): each tensor's min and
    max in one read (`aminmax`: a NaN propagates, an infinity is the min or the max).
    `isfinite(...).all()` gives the same answer in several passes and a bool tensor as large
    as the input (ten times slower on the CPU here, three kernels or more on a GPU)."""
    ends = [m for t in tensors if t.numel() for m in torch.aminmax(t)]
    if not ends:
        return torch.ones((), dtype=torch.bool, device=tensors[0].device if tensors else None)
    return torch.isfinite(torch.stack(ends)).all()


class TableOptimizer:
    """`tables`: (name, parameter) of the model's STEM tables; `layout`: how they are
    kept and trained (config/table_layout.py); `host`: the HostTableStore of host-resident tables."""

    def __init__(self, tables: list[tuple[str, torch.nn.Parameter]], layout: TableLayout,
                 lr_mult: float, weight_decay: float, betas: tuple[float, float],
                 eps: float = 1e-8, dp_group=None, tp_group=None, host=None,
                 devices: Optional[Devices] = None):
        layout.validate()
        if layout.on_host != (host is not None):
            raise ValueError("tables.placement: host needs the HostTableStore (and only it)")
        self.layout, self.lr_mult, self.weight_decay = layout, lr_mult, weight_decay
        self.devices = devices or Devices(parallel.device())
        self._staging = HostStaging(self.devices)
        # the row gradients' sum at the end of a step's last backward (row_grads.py)
        self._collect_streams = side_streams(self.devices.accelerator)
        self.host = host
        self.kernel = AdamKernel(layout.adam_kernel, betas, eps)
        self.partition = _partition(layout, tables[0][1].shape[0], self.devices, dp_group,
                                    host) if tables else None
        self.tp = Comm(tp_group, self.devices, "the tensor-parallel group") \
            if tp_group is not None else None
        # `next_step`: the update runs while the next step computes (overlap.py)
        self.overlap = Overlap(dp_group, self.devices) \
            if layout.overlap == "next_step" and tables else None
        self.step_count = 0
        self.tables = [self.partition.make_state(name, p) for name, p in tables]
        if host is None:  # from now on each backward's row gradients are collected
            for t in self.tables:
                row_grads_of(t.param)
        self.counters = TrafficCounters()  # what the last step moved (see `stats`)
        self._finished = self.counters.as_dict()
        self.rank_rows = 0  # distinct rows of this rank's micro-batches in the last step
        self._norm_ids = self._squares = None  # after sync_grads: for `grad_norm_sq`
        self._read = None  # after sync_grads: (touched rows, looked up, finite), a HostValue

    @property
    def state_on_host(self) -> bool:
        return not self.layout.state_on_accelerator

    def stats(self, wait: bool = True) -> dict[str, float]:
        """This rank's figures for the last step's table path (logged as `tables/*`):
        what it moved (`TrafficCounters`), the distinct rows over data parallel, and the
        memory of the optimizer state it holds (its share of a shared copy's). `wait`:
        for an overlapped update still running, wait for it; else (the trainer's log, which
        must not stall the step it overlaps) the last finished update's counters."""
        if wait:
            self.finish()
        running = self.overlap is not None and self.overlap.running_jobs
        counters = self._finished if running else self.counters.as_dict()
        state = sum((t.master.numel() * 4 if t.separate else 0) +
                    (t.exp_avg.numel() + t.exp_avg_sq.numel()) * 4 for t in self.tables)
        if self.partition is not None:
            state //= self.partition.state_sharers
        where = "cpu" if self.state_on_host else "accelerator"
        return {**counters, "unique_rows": self.touched_rows,
                "rank_rows": self.rank_rows, f"{where}_state_bytes": state}

    def shard(self) -> tuple[int, int, int, int] | None:
        """(first position, rows, shards, this shard's index) of the rows whose optimizer
        state this rank holds (`sharded`; positions of the checkpoint's row order,
        shards.py), None when it holds whole tables."""
        return self.partition.shard if self.partition is not None else None

    # -- the host store's hand-offs -------------------------------------------------------

    def stage(self, microbatches: list[dict], requires_grad: bool = True) -> None:
        """The micro-batches about to run, in order. Host tables: their rows are staged
        (tables/host_tables.py). Device tables, training: their rows are known from the
        host's token ids, so the step's gradients are summed with no sync on a side stream
        as its last backward ends (tables/row_grads.py)."""
        if self.host is not None:
            self.host.stage(microbatches, requires_grad)
        elif requires_grad and self.tables:
            rows = StepRows([host_tokens(mb) for mb in microbatches], self.devices.accelerator)
            for t in self.tables:
                row_grads_of(t.param).expect(rows, self._collect_streams)

    def host_stats(self) -> dict[str, float]:
        return self.host.take_stats() if self.host is not None else {}

    def finish(self) -> None:
        """Wait for an overlapped update (`overlap: next_step`) to be complete: before the
        tables are read whole (evaluation, a save) or the next gradients are taken."""
        if self.overlap is not None:
            self.overlap.finish()

    def publish_rest(self) -> None:
        """An overlapped update (`overlap: next_step`): publish now what the step's lookups
        have not (the trainer calls it before the step's last backward, which the
        publication then runs beside; overlap.py)."""
        if self.overlap is not None:
            self.overlap.publish_all()

    def close(self) -> None:
        try:
            if self.overlap is not None:
                self.overlap.close()
        finally:
            if self.host is not None:
                self.host.close()

    # -- gradients and their norm ---------------------------------------------------------

    @tracked
    def sync_grads(self, read: HostRead | None = None) -> None:
        """Average each table's row gradients over data parallel onto the rows' owners
        (partition.py), take each row's sum of squares for the norm, then hand the
        gradients to where the optimizer state is. What the host learns of them (the rows
        touched over data parallel, whether the lookups read the staged rows, whether this
        rank's gradients were finite) goes into the step's host read `read`
        (runtime/host_read.py; None: one of its own), read with the gradient norm."""
        self.finish()
        self._finished = self.counters.as_dict()  # the last step's, complete
        self.counters.reset()
        self.rank_rows = 0
        self._read = None
        if not self.tables:
            return
        ids, grads, looked_up = self._local_row_grads()
        self.rank_rows = ids.numel()
        # Whether this rank's own row gradients were finite: said when the step is skipped
        # (training/update.py).
        finite = all_finite(grads)
        local, grads, touched = self.partition.sync(ids, grads, self.counters)
        if not isinstance(touched, torch.Tensor):  # known on the host: a fill, no copy
            touched = torch.full((), touched, dtype=torch.float64, device=finite.device)
        self._read = (read or HostRead()).add(torch.stack([
            touched.double().reshape(()), looked_up.double().reshape(()), finite.double()]))
        # The norm's squares where the gradients are, before any copy (no pass on the CPU)
        self._squares = torch.stack([g.double().square().sum(1) for g in grads], 1)
        self._norm_ids = self.partition.ids_of(local)
        rows = self._in_state("rows", local)
        for t, g in zip(self.tables, grads):
            t.rows, t.grad = rows, self._in_state(t.name, g, "grad_d2h_bytes")

    def _read_values(self) -> tuple[int, bool]:
        """(rows touched over data parallel, this rank's gradients finite) of the last
        `sync_grads`, from the host read; refuses a step whose tables were looked up with
        other ids than the ones staged (their gradients would be summed into wrong rows)."""
        if self._read is None:
            return 0, True
        touched, looked_up, finite = self._read.get()
        if not looked_up:
            raise RuntimeError(LOOKED_UP_OTHERS)
        return int(touched), bool(finite)

    @property
    def touched_rows(self) -> int:
        """Distinct rows in the last `sync_grads`, over every data-parallel rank."""
        return self._read_values()[0]

    def _in_state(self, key, tensor: torch.Tensor, counter: str = "") -> torch.Tensor:
        """`tensor` (on the accelerator) where the optimizer state is: CPU state receives it
        in a reused pinned buffer, copied while the backbone steps (`HostStaging`; read
        after `_staging.wait()`), contiguous whatever `tensor`'s strides (a table's columns
        of all tables' gradients): the layout the row op reads."""
        if self.state_on_host:
            return self._staging.copy(key, tensor, self.counters, counter)
        return tensor.contiguous()

    def _local_row_grads(self) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """This rank's touched rows (sorted) and, per table, their summed gradients over
        the step's micro-batches (in the training dtype, on the accelerator; summed as
        tables/row_grads.py says, the same way for both placements); and whether every
        lookup read staged rows (a device bool)."""
        if self.host is not None:
            ids, grads, looked_up = self.host.take_row_grads()
            by_param = {id(m.weight): g for m, g in zip(self.host.modules, grads)}
            grads = [by_param[id(t.param)] for t in self.tables]
            return ids.to(grads[0].device), grads, looked_up
        return take_same_rows([table_row_grads(t.param) for t in self.tables])

    @tracked
    def grad_norm_sq(self) -> torch.Tensor:
        """Squared L2 norm of all table grads (after `sync_grads`), a float64 scalar on the
        accelerator (read with the step's other values), with the same bits for every
        placement and partition on a CPU (so is the clip coefficient): each row's sum of
        squares (float64, summed over its TP slices) put in its place of one [vocabulary,
        tables] array, zero for the other rows; over the ranks that hold disjoint rows'
        grads that array is all-reduced (each row's value comes from one rank, the others
        add zeros: exact); then it is summed once. Nothing is read on the host here: the
        array's size is known without a count exchanged."""
        device = self.devices.accelerator
        if not self.tables:
            return torch.zeros((), dtype=torch.float64, device=device)
        ids, squares = self._norm_ids, self._squares  # [rows, tables]
        if self.tp is not None:
            self.tp.all_reduce(squares)
        every_row = torch.zeros(self.partition.vocab, squares.shape[1], dtype=torch.float64,
                                device=squares.device)
        every_row.index_copy_(0, ids, squares)
        holders = self.partition.norm_comm
        if holders is not None and holders.size > 1:
            holders.all_reduce(every_row)
        return every_row.sum()

    # -- update -------------------------------------------------------------------------

    @tracked
    def step(self, lr: float, clip_coef: float = 1.0,
             next_ids: list[torch.Tensor] | None = None) -> None:
        """Update every table with the gradients of `sync_grads`, scaled by `clip_coef`.
        `next_ids`: the token ids of this rank's next step; with `overlap: next_step` the
        update then finishes in the background while that step runs."""
        self.finish()
        self._read_values()
        if self.host is not None:
            self.host.wait_idle()  # nothing may read a table while it is written
        self.step_count += 1
        if not self.tables:
            return
        # The gradients' copies to the host, queued at `sync_grads` before the backbone's
        # step, have landed by now (their rows are read here, on this thread).
        self._staging.wait()
        lr = lr * self.lr_mult
        if self.overlap is not None and next_ids is not None:
            self._launch_overlapped(lr, clip_coef, next_ids)
            return
        lazy = self.layout.update == "lazy"
        changed = self.partition.changed_ids(self.tables[0].rows if lazy else None,
                                             self.counters) if self.host is not None else None
        for t in self.tables:
            if lazy:
                self.partition.publish(t, t.rows, self._lazy_update(t, clip_coef, lr),
                                       self.counters)
            else:
                self.partition.publish(t, None, self._dense_update(t, clip_coef, lr),
                                       self.counters)
            t.rows = t.grad = None
        if self.host is not None:
            self.partition.barrier()
            self.host.rows_changed(changed)

    def local_grads_finite(self) -> bool:
        """Whether this rank's own row gradients of the last `sync_grads` were finite."""
        return self._read_values()[1]

    def skip(self) -> None:
        """Drop the step's gradients without updating anything (a non-finite step,
        training/update.py): no row, moment or step count changes."""
        self._read_values()
        for t in self.tables:
            t.rows = t.grad = None
        if self.host is not None:
            self.host.rows_changed(torch.empty(0, dtype=torch.long))

    def _state_device(self, t: TableState) -> torch.device:
        return t.exp_avg.device

    def _dense_update(self, t: TableState, clip: float, lr: float) -> torch.Tensor | None:
        """AdamW over every row this rank updates, a chunk of rows at a time (untouched rows
        with a zero gradient, which is no buffer). Returns their new values in the table's
        dtype when the holders need them sent (a separate table of a sharded layout)."""
        rows = self.partition.dense_rows(self._state_device(t))
        values = self._values(t, rows.numel()) \
            if self.partition.sends_rows and t.separate else None
        chunk = max(1, DENSE_CHUNK_BYTES // (4 * t.master.shape[1]))
        for start in range(0, rows.numel(), chunk):
            part = rows[start:start + chunk]
            self._update_rows(t, part, positions_in(part, t.rows), t.grad, clip, lr,
                              None if values is None else values[start:start + chunk])
        return values

    def _lazy_update(self, t: TableState, clip: float, lr: float):
        """Adam on the touched rows; returns their new values in the table's dtype (None
        when the table is its own master: it has them)."""
        values = self._values(t, t.rows.numel()) if t.separate else None
        grad_rows = torch.arange(t.rows.numel(), device=t.rows.device)
        self._update_rows(t, t.rows, grad_rows, t.grad, clip, lr, values)
        return values

    def _values(self, t: TableState, rows: int, start: int = 0) -> torch.Tensor:
        """Rows [start, start + rows) of the table's buffer for updated rows, in the table's
        dtype, where the state is (written by the update itself: bf16 rows cross to the
        accelerator at half the bytes). One buffer per table for the run: a fresh one per
        step would fault in new pages at every step, and on a GPU node it is pinned, so the
        copy to the accelerator is one DMA. (Reused only after `finish`: by then every copy
        out of it has been read.)"""
        if t.values is None:
            shape, dtype = t.exp_avg.shape, t.param.dtype
            t.values = self.devices.host_empty(shape, dtype, pin=True) if self.state_on_host \
                else torch.empty(shape, dtype=dtype, device=self.devices.accelerator)
        return t.values[start:start + rows]

    def _update_rows(self, t: TableState, rows: torch.Tensor, grad_rows: torch.Tensor,
                     grad: torch.Tensor, clip: float, lr: float,
                     out: torch.Tensor | None) -> None:
        """Adam on local rows `rows` with gradients `grad[grad_rows] x clip` (-1: zero), in
        place; their new values into `out` when given."""
        self.kernel.update_rows(self.step_count, lr, self.weight_decay, t.master, t.exp_avg,
                                t.exp_avg_sq, grad, t.master_index(rows), rows, grad_rows, out,
                                grad_scale=clip)
        self.counters.adam_elements += rows.numel() * t.master.shape[1]

    def _launch_overlapped(self, lr: float, clip_coef: float,
                           next_ids: list[torch.Tensor]) -> None:
        """Split each table's update by when the next step reads the rows (its first
        micro-batch, its others: `READY_STAGES`; then the rest) and run it in that order,
        table by table within a stage, in the background (overlap.py)."""
        needed, stage_of = self._next_step_rows(next_ids)
        # The rows that change, the same for every table (`dense`: all this rank updates;
        # `lazy`: the touched ones), split once.
        t0 = self.tables[0]
        rows = self.partition.dense_rows(self._state_device(t0)) \
            if self.layout.update == "dense" else t0.rows
        at = positions_in(rows, needed)
        stage = torch.where(at >= 0, stage_of[at.clamp(min=0)], READY_STAGES)
        # A step of one micro-batch has no rows for its later ones: no jobs for them.
        kinds = [*range(min(READY_STAGES, len(next_ids))), READY_STAGES]
        parts = [rows[stage == k] for k in kinds]
        counts = self._part_counts(parts)
        grad_rows = [positions_in(part, t0.rows) for part in parts]  # (t.rows: the same)
        starts = list(itertools.accumulate((part.numel() for part in parts), initial=0))
        names = STAGE_NAMES + ("other rows",)
        stages: list[list] = [[] for _ in kinds[:-1]]
        rest = []
        for t in self.tables:
            for i, k in enumerate(kinds):
                job = self._row_job(t, parts[i], grad_rows[i], clip_coef, lr, starts[i],
                                    names[k], counts[i])
                if k < READY_STAGES:
                    stages[i].append((t.param, job))
                else:
                    rest.append(job)
            t.rows = t.grad = None
        self.overlap.launch(stages, rest)

    def _part_counts(self, parts: list[torch.Tensor]) -> list[list[int]]:
        """For each part of the update, how many rows each rank publishes (one exchange
        and one host read for them all, here at the launch, rather than one of each per
        publication in the next step's forward)."""
        comm = self.overlap.comm
        if comm.size == 1:
            return [[p.numel()] for p in parts]
        mine = self.devices.to_accelerator(torch.tensor([p.numel() for p in parts]),
                                           non_blocking=True)  # (staged: no sync)
        gathered = [torch.empty_like(mine) for _ in range(comm.size)]
        comm.all_gather(gathered, mine)
        by_rank = torch.stack(gathered).tolist()
        return [[counts[k] for counts in by_rank] for k in range(len(parts))]

    def _next_step_rows(self, next_ids: list[torch.Tensor]) -> tuple[torch.Tensor,
                                                                     torch.Tensor]:
        """The local rows any rank's next step reads (sorted, where the state is), and the
        stage of the first micro-batch that reads each (0: the first micro-batch; 1: a
        later one), over all ranks: one exchange with the rows' owners."""
        per_mb = [i.flatten() for i in next_ids]
        ids, stages = earliest(torch.cat(per_mb), torch.cat([
            torch.full_like(i, min(k, READY_STAGES - 1)) for k, i in enumerate(per_mb)]),
            READY_STAGES)

        def to(t):  # no sync: a pageable source is staged by the driver as it returns
            return self.devices.to_accelerator(t, non_blocking=True)
        needed, stage_of = self.partition.shards.needed_by_any(to(ids), self.counters,
                                                               to(stages), READY_STAGES)
        if self.state_on_host:  # both in one copy
            return self.devices.to_host(torch.stack([needed, stage_of])).unbind()
        return needed, stage_of

    def _row_job(self, t: TableState, rows: torch.Tensor, grad_rows: torch.Tensor,
                 clip: float, lr: float, start: int, what: str, counts: list[int]) -> Job:
        """The update of local rows `rows` (its arithmetic) and their publication
        (`counts`: how many rows each rank publishes): gradients `t.grad[grad_rows]` x
        `clip` (-1: an untouched row, zero; `positions_in(rows, t.rows)`); their new values
        in rows [start, ...) of the table's buffer (none for a table that is its own
        master)."""
        grad = t.grad
        values = self._values(t, rows.numel(), start) if t.separate else None

        def compute() -> None:
            self._update_rows(t, rows, grad_rows, grad, clip, lr, values)

        def publish(comm: Comm) -> None:
            self.partition.publish(t, rows, values, self.counters, holders=comm,
                                   counts=counts)
        return Job(f"step {self.step_count}, {t.name}: {what}", compute, publish,
                   (rows, grad_rows, grad))

    # -- checkpoint ---------------------------------------------------------------------

    @tracked
    def state_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """{table name: {"fp32_param", "exp_avg", "exp_avg_sq"}}: this rank's rows of the
        states in the checkpoint's row order (states.py)."""
        self.finish()
        return checkpoint_states(self.partition, self.tables)

    @tracked
    def load_state_tensors(self, states: dict[str, dict[str, torch.Tensor]], step: int) -> None:
        """Take the optimizer state of a checkpoint (shaped like `state_tensors()`) and
        bring every holder's table in line with the masters (states.py)."""
        self.step_count = step
        if self.host is not None:
            self.host.invalidate()
        load_states(self.partition, self.tables, states, self.counters)
