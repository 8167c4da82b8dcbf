"""The STEM tables' optimizer, ZeRO-Offload style, outside the DeepSpeed engine.

Why outside: DeepSpeed's ZeRO cannot take sparse gradients, and a dense gradient of all
tables (21 GB fp32 at 1B) per step would cost more than the whole backbone. So:

* the model's table parameters produce row-sparse gradients (`StemTable.sparse_grad`):
  only the rows of the micro-batches' token ids, summed per row the same way for every
  placement (training/row_grads.py);
* `sync_grads` averages them over data parallel on the union of the ranks' rows (one
  all-reduce of `rows x width` per table), exactly like the engine averages dense grads;
* fp32 master weights and Adam moments live in CPU memory; DeepSpeed's CPU Adam
  arithmetic updates the touched rows where they are (`AdamKernel.update_rows`, a
  row-indexed op built from DeepSpeed's kernel source) and the changed rows, cast to the
  table's dtype by the same pass, are copied back into the model's table.

Host-resident tables (`tables.placement: host`, training/host_tables.py): the host table
IS the fp32 master (one copy per node, shared by the node's ranks, with its Adam moments).
The row gradients come from the store's staged rows instead of sparse grads, and the rows
are owned for the update: the ranks sharing a copy split its rows (`lazy`: row % ranks,
balanced under Zipfian ids; `dense`: contiguous ranges, so each update is one slice).
`sync_grads` reduces each row's gradient to its owner only (one reduce per owner over the
sharers: a reduce-scatter, in collectives gloo has too; then an all-reduce of the owned
rows among the owners of the same rows on other copies); the owner updates the shared
copy, so nothing is broadcast and no CPU work or memory is duplicated per GPU.

Partition (`tables.partition`): with `sharded` (the default) each data-parallel rank owns
1/n of the rows of every table (an interleaved sample of the vocabulary, so every rank
gets its share of the frequent ids): their fp32 master, Adam moments and update live on
that rank only, gradients travel to the owners and updated rows back to every holder
(training/table_shards.py). `replicated` is the path described above: every rank (device
placement) or every node's copy (host placement) keeps and updates the whole table's
state; it is the reference the sharded path is tested against.

Update semantics (`optimizer.tables.update`):
* `dense`: AdamW on every row every step, untouched rows with a zero gradient (the
  paper's reference code): momentum and weight decay keep moving unseen rows.
* `lazy`: Adam on the touched rows only (torch `SparseAdam` semantics: a row's moments
  change only when it is touched, bias correction follows the global step; decoupled
  weight decay applies to touched rows). Cost follows touched rows, not vocabulary.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_stem import parallel
from megatron_stem.training.row_grads import RowGradSum, row_grads_of, take_same_rows
from megatron_stem.training.table_overlap import Overlap
from megatron_stem.training.table_shards import (
    ID_BYTES,
    RowShards,
    TrafficCounters,
    all_gather_padded,
    interleaved_order,
)

_kernel_ids = itertools.count(10_000)  # DeepSpeed keys CPU Adam instances by integer id
DENSE_CHUNK_BYTES = 64 << 20  # `dense` updates this many bytes of fp32 rows at a time


class AdamKernel:
    """In-place AdamW on contiguous fp32 CPU tensors: DeepSpeed's `cpu_adam` op, or the
    same arithmetic in torch where the op cannot be built (no compiler).

    An element's new value must not depend on what else the call updates (a resumed run,
    another placement or data-parallel layout slices the same rows differently). Two
    things of the op do, and `update` works around both:
    * it keeps beta1^t and beta2^t as running float32 products, multiplied once per call,
      and recomputes them with `pow` (other bits at most steps) when a call's step is not
      the previous call's plus one: after a resume, after a step in which this rank had
      no rows to update, and on every call but the first of a step (one per table, chunk
      or overlap phase). So each update is preceded by a call at step 0 on empty tensors:
      the op then takes `pow` at every step (exactly beta at step 1), the same bits
      whatever was called before; nothing is needed at load time.
    * it updates whole SIMD vectors, then the last `numel % SIMD width` elements in scalar
      code that rounds differently (exp_avg and exp_avg_sq differ by an ulp): those are
      updated in a zero-padded vector instead, so every element goes through vector code.
    """

    VECTOR = 64  # elements: a multiple of every SIMD width the op is built for

    def __init__(self, kind: str, betas: tuple[float, float], eps: float):
        self.betas, self.eps = betas, eps
        self.kind = kind
        self.row_op = self._op = None
        if kind == "deepspeed":
            from megatron_stem.ops import load_row_adam

            self.row_op = load_row_adam()

    @property
    def op(self):
        """DeepSpeed's flat CPU Adam op, loaded (built) on first use: the tables' updates
        go through `update_rows`; `update` is the flat reference it is tested against."""
        if self._op is None and self.kind == "deepspeed":
            from megatron_stem.ops import load_cpu_adam

            self._op, self.id = load_cpu_adam(), next(_kernel_ids)
            self._op.create_adam(self.id, 0.0, *self.betas, self.eps, 0.0, True, False)
        return self._op

    def update(self, step: int, lr: float, weight_decay: float, param: torch.Tensor,
               grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        if self.op is not None:
            flat = [t.view(-1) for t in (param, grad, exp_avg, exp_avg_sq)]
            body = param.numel() - param.numel() % self.VECTOR
            self._op_update(step, lr, weight_decay, [t[:body] for t in flat])
            if body < param.numel():
                self._padded_update(step, lr, weight_decay, [t[body:] for t in flat])
            return
        b1, b2 = self.betas
        param.mul_(1 - lr * weight_decay)
        exp_avg.lerp_(grad, 1 - b1)
        exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1 - b2)
        denom = (exp_avg_sq.sqrt() / math.sqrt(1 - b2 ** step)).add_(self.eps)
        param.addcdiv_(exp_avg, denom, value=-lr / (1 - b1 ** step))

    def update_rows(self, step: int, lr: float, weight_decay: float, param: torch.Tensor,
                    exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grads: torch.Tensor,
                    param_rows: torch.Tensor, state_rows: torch.Tensor,
                    grad_rows: torch.Tensor, out: torch.Tensor | None = None) -> None:
        """AdamW on rows `param_rows` of `param` with rows `state_rows` of the moments and
        gradients `grads[grad_rows]` (a row < 0: a zero gradient), in place; the new rows
        also into `out` (any float dtype: the table's) when given. Per element the
        arithmetic of `update`.

        DeepSpeed: its arithmetic in a row-indexed op (csrc/row_adam.cpp) that updates the
        rows where they are. Torch: the rows gathered into contiguous buffers, updated and
        scattered back, which moves the master and moments twice more than Adam does."""
        if self.row_op is not None:
            self.row_op.adam_update_rows(
                step, lr, *self.betas, self.eps, weight_decay, param, exp_avg, exp_avg_sq,
                grads, param_rows, state_rows, grad_rows,
                out if out is not None else torch.empty(0))
            return
        p, m, v = (x.index_select(0, r) for x, r in
                   ((param, param_rows), (exp_avg, state_rows), (exp_avg_sq, state_rows)))
        g = torch.zeros_like(p)  # rows without a gradient (-1) stay zero
        hit = grad_rows >= 0
        g[hit] = grads[grad_rows[hit]]
        if p.numel():
            self.update(step, lr, weight_decay, p, g, m, v)
        for dst, rows, src in ((param, param_rows, p), (exp_avg, state_rows, m),
                               (exp_avg_sq, state_rows, v)):
            dst.index_copy_(0, rows, src)
        if out is not None:
            out.copy_(p)

    def _op_update(self, step, lr, weight_decay, tensors: list[torch.Tensor]) -> None:
        """tensors: param, grad, exp_avg, exp_avg_sq (after a step-0 call: see the class)"""
        b1, b2 = self.betas
        replay_deepspeed_steps(self.op, self.id, -1, 0, self.betas, self.eps)
        self.op.adam_update(self.id, step, lr, b1, b2, self.eps, weight_decay, True, *tensors)

    def _padded_update(self, step, lr, weight_decay, tail: list[torch.Tensor]) -> None:
        """Update `tail` (fewer than VECTOR elements each) through the op's vector code."""
        padded = torch.zeros(len(tail), self.VECTOR)  # zeros stay zeros (and finite)
        padded[:, :tail[0].numel()] = torch.stack(tail)
        self._op_update(step, lr, weight_decay, list(padded.unbind(0)))
        for i in (0, 2, 3):  # the grad is only read
            tail[i].copy_(padded[i, :tail[i].numel()])


def replay_deepspeed_steps(op, opt_id: int, seen: int, upto: int,
                           betas: tuple[float, float], eps: float) -> None:
    """Advance DeepSpeed CPU Adam instance `opt_id` (op `op`), last called at step `seen`,
    through steps seen+1..upto without touching any tensor, so that its running beta
    powers are those of an instance that ran every step (see `AdamKernel`). For
    DeepSpeed's own `DeepSpeedCPUAdam` too, which restarts at step 0 after a load."""
    empty = torch.empty(0)
    for step in range(seen + 1, upto + 1):
        op.adam_update(opt_id, step, 0.0, betas[0], betas[1], eps, 0.0, True,
                       empty, empty, empty, empty)


@dataclass
class TableState:
    name: str
    param: torch.nn.Parameter  # the model's table (this TP rank's column slice)
    master: torch.Tensor  # fp32, CPU; the param itself when that is fp32 on CPU already
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    # Whether the model's table is a copy of the master that updates must reach (a GPU or
    # bf16 table); an fp32 CPU table is the master itself (or holds it, sharded).
    separate: bool
    # The master rows of the state's rows (the moments' rows 0, 1, ...): None when they
    # are the same; a shard's table rows when the master is the whole table.
    master_rows: torch.Tensor | None = None
    rows: torch.Tensor | None = None  # after sync_grads: touched state rows (sorted)
    grad: torch.Tensor | None = None  # after sync_grads: their DP-averaged grads
    values: torch.Tensor | None = None  # updated rows in the table's dtype (`_values`)

    def master_index(self, rows: torch.Tensor) -> torch.Tensor:
        return rows if self.master_rows is None else self.master_rows[rows]


def _is_own_master(param: torch.nn.Parameter, state_device: str = "cpu") -> bool:
    """An fp32 table where the optimizer state lives is its own fp32 master; any other
    gets a separate one."""
    return param.device.type == torch.device(state_device).type and \
        param.dtype == torch.float32


def cpu_state_bytes(tables: list[tuple[str, torch.nn.Parameter]], shards: int = 1) -> int:
    """CPU memory a device-placement TableOptimizer allocates for `tables` on each rank:
    two fp32 Adam moments, and an fp32 master unless the table is its own, of 1/`shards`
    of the rows (`partition: sharded` over that many data-parallel ranks)."""
    return sum(p.numel() * 4 * (2 if _is_own_master(p) else 3) for _, p in tables) // shards


class TableOptimizer:
    """`host`: the HostTableStore of host-resident tables (None: device-resident).
    `partition`: "sharded" or "replicated" (module docstring)."""

    def __init__(self, tables: list[tuple[str, torch.nn.Parameter]], update: str,
                 lr_mult: float, weight_decay: float, betas: tuple[float, float],
                 eps: float = 1e-8, kernel: str = "deepspeed", dp_group=None, tp_group=None,
                 host=None, partition: str = "sharded", overlap: str = "none",
                 state_device: str = "cpu"):
        if update not in ("dense", "lazy"):
            raise ValueError(f"unknown table update {update!r}")
        if partition not in ("sharded", "replicated"):
            raise ValueError(f"unknown table partition {partition!r}")
        self.update_mode, self.lr_mult, self.weight_decay = update, lr_mult, weight_decay
        self.dp_group, self.tp_group = dp_group, tp_group
        self.host = host
        self.copy = host.copy if host is not None else None
        self.shards = RowShards(tables[0][1].shape[0], dp_group) \
            if partition == "sharded" and tables else None
        if overlap not in ("none", "next_step"):
            raise ValueError(f"unknown table overlap {overlap!r}")
        if overlap == "next_step" and (self.shards is None or host is not None):
            raise ValueError("table overlap next_step needs sharded, device-placed tables")
        if state_device != "cpu" and (self.shards is None or host is not None):
            raise ValueError("table optimizer state off the CPU needs sharded, device-placed "
                             "tables")
        # Where the fp32 master and moments live and Adam runs: the CPU (DeepSpeed's kernel)
        # or the accelerator (torch's arithmetic there), for tables whose state fits it.
        self.state_device = torch.device(state_device)
        if self.state_device.type != "cpu":
            kernel = "torch"
        # `next_step`: the update runs while the next step computes (training/table_overlap.py)
        self.overlap = Overlap(dp_group) if overlap == "next_step" and tables else None
        self.kernel = AdamKernel(kernel, betas, eps)
        self.step_count = 0
        self.tables = [self._state(name, p) for name, p in tables]
        if host is None:  # from now on each backward's row gradients are collected
            for t in self.tables:
                row_grads_of(t.param)
        self.counters = TrafficCounters()  # what the last step moved (see `stats`)
        self.touched_rows = 0  # distinct rows in the last sync_grads (all DP ranks)
        self.rank_rows = 0  # ... of this rank's micro-batches
        self._step_rows = None  # host: the rows the step updates on the copy (all owners)

    def stats(self) -> dict[str, float]:
        """This rank's figures for the last step's table path (logged as `tables/*`):
        what it moved (`TrafficCounters`), the distinct rows over data parallel, and the
        CPU memory of the optimizer state it holds (its share of a shared copy's)."""
        self.finish()
        state = sum((t.master.numel() * 4 if t.separate else 0) +
                    (t.exp_avg.numel() + t.exp_avg_sq.numel()) * 4 for t in self.tables)
        if self.shards is None and self.copy is not None:
            state //= self.copy.size
        where = "cpu" if self.state_device.type == "cpu" else "accelerator"
        return {**self.counters.as_dict(), "unique_rows": self.touched_rows,
                "rank_rows": self.rank_rows, f"{where}_state_bytes": state}

    def _state(self, name: str, param: torch.nn.Parameter) -> TableState:
        own = _is_own_master(param, self.state_device)
        if self.shards is not None:  # this rank's rows only; moments private to it
            owned = self.shards.owned.to(param.device)
            shape = (self.shards.rows, param.shape[1])
            moments = [torch.zeros(shape, device=self.state_device) for _ in range(2)]
            if own:  # updated in place in the table
                return TableState(name, param, param.data, *moments, separate=False,
                                  master_rows=owned)
            master = param.detach()[owned].to(self.state_device, torch.float32)
            return TableState(name, param, master, *moments, separate=True)
        master = param.data if own else param.detach().to("cpu", torch.float32).clone()
        if self.copy is not None:  # moments shared by the copy's ranks, like the table
            return TableState(name, param, master,
                              *(self.copy.tensor(f"{name}.{k}", tuple(master.shape))
                                for k in ("exp_avg", "exp_avg_sq")), separate=not own)
        return TableState(name, param, master, torch.zeros_like(master),
                          torch.zeros_like(master), separate=not own)

    def shard(self) -> tuple[int, int, int, int] | None:
        """(first position, rows, shards, this shard's index) of the rows whose optimizer
        state this rank holds (`sharded`; positions in `interleaved_order`, the order of
        `state_tensors()`' rows), None when it holds whole tables (`replicated`)."""
        s = self.shards
        return None if s is None else (s.lo, s.rows, s.size, s.rank)

    # -- the host store's hand-offs -------------------------------------------------------

    def stage(self, microbatches: list[dict], requires_grad: bool = True) -> None:
        """Host tables: the micro-batches about to run, in order (training/host_tables.py).
        Nothing to do for device-resident tables."""
        if self.host is not None:
            self.host.stage(microbatches, requires_grad)

    def host_stats(self) -> dict[str, float]:
        return self.host.take_stats() if self.host is not None else {}

    def finish(self) -> None:
        """Wait for an overlapped update (`overlap: next_step`) to be complete: before the
        tables are read whole (evaluation, a save) or the next gradients are taken."""
        if self.overlap is not None:
            self.overlap.finish()

    def close(self) -> None:
        if self.overlap is not None:
            self.overlap.close()
        if self.host is not None:
            self.host.close()

    # -- gradients ----------------------------------------------------------------------

    def sync_grads(self) -> None:
        """Sum each table's row gradients and average them over data parallel: on
        the rows' owners (`sharded`), or on every rank / each copy's owners (`replicated`)."""
        self.finish()
        self.counters.reset()
        if self.shards is not None:
            self._sync_to_owners()
        elif self.host is not None:
            self._sync_host_grads()
        else:
            self._sync_replicated()

    def _sync_replicated(self) -> None:
        self.touched_rows = 0
        if not self.tables:
            return
        rows, grads = self._local_row_grads()  # one row set: every table sees the same ids
        self.rank_rows = rows.numel()
        for t, g in zip(self.tables, grads):
            union, values = self._average_over_dp(rows, g.float())
            t.rows, t.grad = union.cpu(), self._to_state(values)
        self.touched_rows = self.tables[0].rows.numel()

    def _local_row_grads(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """This rank's touched rows (sorted) and, per table, their summed gradients over
        the step's micro-batches (in the training dtype, on the device; summed as
        training/row_grads.py says, the same way for both placements)."""
        if self.host is not None:
            rows, grads = self.host.take_row_grads()
            by_param = {id(m.weight): g for m, g in zip(self.host.modules, grads)}
            grads = [by_param[id(t.param)] for t in self.tables]
            return rows.to(grads[0].device), grads
        return take_same_rows([_row_grads(t.param) for t in self.tables])

    def _sync_to_owners(self) -> None:
        rows, grads = self._local_row_grads()
        self.rank_rows = rows.numel()
        width = grads[0].shape[1] if grads else 0
        owned, summed = self.shards.to_owners(rows, torch.cat(grads, 1), self.counters)
        summed = self._to_state(summed / self.shards.size)
        owned = owned.to(self.state_device)
        for t, g in zip(self.tables, summed.split(width, 1)):
            t.rows, t.grad = owned, g.contiguous()
        count = torch.tensor([owned.numel()], device=parallel.device())
        if self.shards.size > 1:
            dist.all_reduce(count, group=self.dp_group)
        self.touched_rows = int(count)

    def _to_state(self, grads: torch.Tensor) -> torch.Tensor:
        """Gradients where the optimizer state is (counted when they leave the device)."""
        if grads.device != self.state_device:
            self.counters.grad_d2h_bytes += grads.numel() * grads.element_size()
        return grads.to(self.state_device)

    def _dp_world(self) -> int:
        return dist.get_world_size(self.dp_group) if dist.is_initialized() else 1

    def _union_over_dp(self, rows: torch.Tensor) -> torch.Tensor:
        """Sorted union of every DP rank's (sorted, unique) rows."""
        world = self._dp_world()
        if world == 1:
            return rows
        (gathered,), longest = all_gather_padded([rows], self.dp_group, world)
        self.counters.index_bytes += world * longest * ID_BYTES
        return torch.unique(torch.cat(gathered))

    def _average_over_dp(self, rows: torch.Tensor, values: torch.Tensor):
        world = self._dp_world()
        if world == 1:
            return rows, values
        union = self._union_over_dp(rows)
        summed = torch.zeros(union.numel(), values.shape[1], dtype=values.dtype,
                             device=values.device)
        summed[torch.searchsorted(union, rows)] = values
        dist.all_reduce(summed, group=self.dp_group)
        self.counters.grad_bytes += summed.numel() * summed.element_size()
        return union, summed / world

    def _sync_host_grads(self) -> None:
        """Row grads from the staged rows, summed over DP onto each row's owner only."""
        rows, grads = self.host.take_row_grads()
        self.rank_rows = rows.numel()
        grads = {id(m.weight): g for m, g in zip(self.host.modules, grads)}
        device = grads[id(self.tables[0].param)].device if self.tables else rows.device
        union = self._union_over_dp(rows.to(device))
        owner = self._owner(union)
        size, me = self.copy.size, self.copy.index
        # The union ordered by owner (rows ascending within each owner's chunk).
        order = torch.sort(owner, stable=True).indices
        counts = torch.bincount(owner, minlength=size).tolist()
        place = torch.empty_like(order)
        place[order] = torch.arange(order.numel(), device=order.device)
        mine = place[torch.searchsorted(union, rows.to(device))]
        start = sum(counts[:me])
        owned = union[order][start:start + counts[me]]
        world = self._dp_world()
        for t in self.tables:
            g = grads[id(t.param)]
            # Summed over the ranks in fp32, like `_average_over_dp` (the device path's).
            summed = torch.zeros(union.numel(), g.shape[1], device=device)
            summed[mine] = g
            chunks = summed.split(counts)
            if self.copy.group is not None:
                for j, chunk in enumerate(chunks):
                    if chunk.numel():
                        dist.reduce(chunk, dst=dist.get_global_rank(self.copy.group, j),
                                    group=self.copy.group)
                        self.counters.grad_bytes += chunk.numel() * chunk.element_size()
            chunk = chunks[me]
            if self.copy.cross_group is not None:
                dist.all_reduce(chunk, group=self.copy.cross_group)
                self.counters.grad_bytes += chunk.numel() * chunk.element_size()
            t.rows, t.grad = owned.cpu(), self._to_state(chunk / world)
        self._step_rows = union.cpu()
        self.touched_rows = union.numel()

    def _owner(self, rows: torch.Tensor) -> torch.Tensor:
        """Which of the copy's ranks updates each row (host placement)."""
        if self.update_mode == "lazy":
            return rows % self.copy.size
        return rows * self.copy.size // self._vocab()

    def _owned_range(self) -> tuple[int, int]:
        """`dense`: the state rows [lo, hi) this rank updates: its shard's (`sharded`),
        its part of a shared host copy, or all rows."""
        if self.shards is not None:
            return 0, self.shards.rows
        vocab = self._vocab()
        if self.copy is None:
            return 0, vocab
        size, me = self.copy.size, self.copy.index
        return -(-me * vocab // size), -(-(me + 1) * vocab // size)

    def _vocab(self) -> int:
        return self.tables[0].param.shape[0]

    def grad_norm_sq(self) -> float:
        """Squared L2 norm of all table grads (after `sync_grads`), with the same bits for
        every placement and partition (so is the clip coefficient): each row's sum of
        squares (float64, summed over its TP slices), gathered from the ranks that hold
        disjoint rows' grads (the shards' owners, or the owners of a shared host copy) into
        one vector in row order, which is summed once."""
        if not self.tables:
            return 0.0
        device = parallel.device() if dist.is_initialized() else torch.device("cpu")
        rows = self.tables[0].rows  # every table has the step's one row set
        if self.shards is not None:  # a shard's local rows: as table rows
            rows = self.shards.table_rows(rows)
        rows = rows.to(device)
        squares = torch.stack([t.grad.double().square().sum(1) for t in self.tables], 1) \
            .to(device)  # [rows, tables]
        if dist.is_initialized() and self.tp_group is not None:
            dist.all_reduce(squares, group=self.tp_group)
        holders = self._dp() if self.shards is not None else \
            self.copy.group if self.copy is not None else None
        size = dist.get_world_size(holders) if holders is not None else 1
        if size > 1:
            (rows, squares), _ = all_gather_padded([rows, squares], holders, size)
            rows, squares = torch.cat(rows), torch.cat(squares)
            squares = squares[torch.argsort(rows)]
        return float(squares.sum())

    # -- update -------------------------------------------------------------------------

    def step(self, lr: float, clip_coef: float = 1.0,
             next_ids: list[torch.Tensor] | None = None) -> None:
        """Update every table with the gradients of `sync_grads`, scaled by `clip_coef`.
        `next_ids`: the token ids of this rank's next step; with `overlap: next_step` the
        update then finishes in the background while that step runs."""
        self.finish()
        if self.host is not None:
            self.host.wait_idle()  # nothing may read a table while it is written
        self.step_count += 1
        lr = lr * self.lr_mult
        if self.overlap is not None and next_ids is not None:
            self._launch_overlapped(lr, clip_coef, next_ids)
            return
        changed = self._changed_rows()
        for t in self.tables:
            grad = t.grad * clip_coef if clip_coef != 1.0 else t.grad
            if self.update_mode == "dense":
                self._publish_shard(t, self._dense_update(t, grad, lr))
            else:
                self._publish_rows(t, t.rows, self._lazy_update(t, grad, lr))
            t.rows = t.grad = None
        if self.host is not None:
            self.copy.barrier()  # every owner has written its rows of the shared copy
            self.host.rows_changed(changed)

    def _changed_rows(self) -> torch.Tensor | None:
        """Host tables: the rows this step changes in the copy, which the row cache must
        refresh (None: every row, `dense`)."""
        if self.host is None or self.update_mode == "dense":
            return None
        if self.shards is None:
            return self._step_rows
        return self.shards.all_rows(self.shards.table_rows(self.tables[0].rows),
                                    self.counters)

    def _dense_update(self, t: TableState, grad: torch.Tensor,
                      lr: float) -> torch.Tensor | None:
        """AdamW over the owned rows, a chunk of rows at a time (untouched rows with a zero
        gradient, which is no buffer). Returns the owned rows' new values in the table's
        dtype when a sharded table's holders need them, else None."""
        lo, hi = self._owned_range()
        values = self._values(t, hi - lo) if self.shards is not None and t.separate else None
        chunk = max(1, DENSE_CHUNK_BYTES // (4 * t.master.shape[1]))
        for start in range(lo, hi, chunk):
            rows = torch.arange(start, min(start + chunk, hi), device=t.exp_avg.device)
            self._update_rows(t, rows, self._grad_rows(rows, t.rows), grad, lr,
                              None if values is None else values[start - lo:start - lo + chunk])
        return values

    def _lazy_update(self, t: TableState, grad: torch.Tensor, lr: float):
        """Adam on the touched rows; returns their new values in the table's dtype (None
        when the table is its own master: it has them)."""
        values = self._values(t, t.rows.numel()) if t.separate else None
        grad_rows = torch.arange(t.rows.numel(), device=t.rows.device)
        self._update_rows(t, t.rows, grad_rows, grad, lr, values)
        return values

    def _values(self, t: TableState, rows: int, start: int = 0) -> torch.Tensor:
        """Rows [start, start + rows) of the table's buffer for updated rows, in the table's
        dtype, where the state is (written by the update itself: bf16 rows cross to the
        accelerator at half the bytes). One buffer per table for the run: a fresh one per
        step would fault in new pages at every step, and on a GPU node it is pinned, so the
        copy to the accelerator is one DMA. (Reused only after `finish`: by then every copy
        out of it has been read.)"""
        if t.values is None:
            device = t.exp_avg.device
            t.values = torch.empty(t.exp_avg.shape, dtype=t.param.dtype, device=device,
                                   pin_memory=device.type == "cpu" and t.param.is_cuda)
        return t.values[start:start + rows]

    @staticmethod
    def _grad_rows(rows: torch.Tensor, touched: torch.Tensor) -> torch.Tensor:
        """For each of `rows` (sorted), its index in `touched` (sorted), -1 if absent."""
        if not touched.numel():
            return torch.full_like(rows, -1)
        at = torch.searchsorted(touched, rows).clamp(max=touched.numel() - 1)
        return torch.where(touched[at] == rows, at, -1)

    def _update_rows(self, t: TableState, rows: torch.Tensor, grad_rows: torch.Tensor,
                     grad: torch.Tensor, lr: float, out: torch.Tensor | None) -> None:
        """Adam on state rows `rows` with gradients `grad[grad_rows]` (-1: zero), in place;
        their new values into `out` when given."""
        self.kernel.update_rows(self.step_count, lr, self.weight_decay, t.master, t.exp_avg,
                                t.exp_avg_sq, grad, t.master_index(rows), rows, grad_rows, out)
        self.counters.adam_elements += rows.numel() * t.master.shape[1]

    def _launch_overlapped(self, lr: float, clip_coef: float,
                           next_ids: list[torch.Tensor]) -> None:
        """Split each table's update into the rows the next step reads (first, table by
        table) and the rest, and run both in the background (training/table_overlap.py)."""
        ids = torch.unique(torch.cat([i.flatten() for i in next_ids]))
        needed = self.shards.needed_by_any(ids.to(parallel.device()), self.counters) \
            .to(self.state_device)
        owned = torch.arange(self.shards.rows, device=self.state_device)
        first, rest = [], []
        for t in self.tables:
            grad = t.grad * clip_coef if clip_coef != 1.0 else t.grad
            rows = owned if self.update_mode == "dense" else t.rows  # the rows that change
            now = torch.isin(rows, needed)
            first.append((t.param, self._row_job(t, rows[now], grad, lr, 0)))
            rest.append(self._row_job(t, rows[~now], grad, lr, int(now.sum())))
            t.rows = t.grad = None
        self.overlap.launch(first, rest)

    def _row_job(self, t: TableState, rows: torch.Tensor, grad: torch.Tensor, lr: float,
                 start: int):
        """The update of state rows `rows` and their publication, as a job for `Overlap`:
        gradients of the touched rows (`t.rows`) from `grad`, zero for the others; their
        new values in rows [start, ...) of the table's buffer (none for a table that is its
        own master: it has them)."""
        grad_rows = self._grad_rows(rows, t.rows)

        def job(group):
            values = self._values(t, rows.numel(), start) if t.separate else None
            self._update_rows(t, rows, grad_rows, grad, lr, values)
            self.shards.gather_rows(t.param.data, self.shards.table_rows(rows), values, group,
                                    self.counters)
        return job

    def _publish_shard(self, t: TableState, values: torch.Tensor | None) -> None:
        """`dense`: the updated rows to every holder of the table (module docstring);
        `values`: the shard's rows in the table's dtype (None: the table has them)."""
        if self.shards is None:  # replicated: this rank's master has every row
            if t.separate:
                t.param.data.copy_(t.master, non_blocking=True)
            return
        self.shards.gather_shards(t.param.data, values, self._holders(), self.counters)

    def _publish_rows(self, t: TableState, rows: torch.Tensor,
                      values: torch.Tensor | None) -> None:
        """`lazy`: like `_publish_shard` for the updated (state) `rows` only."""
        if self.shards is None:
            if t.separate:
                t.param.data.index_copy_(0, rows.to(t.param.device),
                                         values.to(t.param.device))
            return
        self.shards.gather_rows(t.param.data, self.shards.table_rows(rows), values,
                                self._holders(), self.counters)

    def _holders(self):
        """The group whose ranks' tables need this rank's updated rows (`sharded`): every
        data-parallel rank's device table, or the other nodes' host copies (this rank's
        own copy has them already: the master is a slice of it)."""
        return self._dp() if self.copy is None else self.copy.cross_group

    def _dp(self):
        """The data-parallel group (None stands for the whole world in torch.distributed,
        but for "no group" in the copy's groups: spelled out here)."""
        return self.dp_group or (dist.group.WORLD if dist.is_initialized() else None)

    # -- checkpoint ---------------------------------------------------------------------

    def state_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """{table name: {"fp32_param", "exp_avg", "exp_avg_sq"}}: this rank's rows of the
        states (its shard's under `sharded`, see `shard()`) in the checkpoint's row order,
        `interleaved_order` (training/table_shards.py): the live tensors where they are in
        that order already, copies where not (a shard's rows of a table that is its own
        master, and `replicated`'s whole tables, kept in row id order)."""
        self.finish()
        return {t.name: {key: live if rows is None else live[rows]
                         for key, (live, rows) in self._checkpoint_rows(t).items()}
                for t in self.tables}

    def _checkpoint_rows(self, t: TableState):
        """{state: (live tensor, its rows in checkpoint order, None: all of them)}"""
        if self.shards is not None:
            return {"fp32_param": (t.master, t.master_rows), "exp_avg": (t.exp_avg, None),
                    "exp_avg_sq": (t.exp_avg_sq, None)}
        order = interleaved_order(self._vocab())
        return {key: (live, order.to(live.device)) for key, live in
                (("fp32_param", t.master), ("exp_avg", t.exp_avg),
                 ("exp_avg_sq", t.exp_avg_sq))}

    def load_state_tensors(self, states: dict[str, dict[str, torch.Tensor]], step: int) -> None:
        """Take the optimizer state of a checkpoint (`states` shaped like
        `state_tensors()`; loading into those tensors themselves copies nothing) and bring
        every holder's table in line with the masters."""
        self.step_count = step
        if self.host is not None:
            self.host.invalidate()
        # One writer per shared copy (replicated); every owner its own rows (sharded).
        writer = self.shards is not None or self.copy is None or self.copy.index == 0
        for t in self.tables:
            if writer:
                for key, (live, rows) in self._checkpoint_rows(t).items():
                    loaded = states[t.name][key]
                    if rows is not None:
                        live.index_copy_(0, rows, loaded.to(live.device))
                    elif loaded.data_ptr() != live.data_ptr():
                        live.copy_(loaded)
            self._publish_shard(t, t.master if t.separate else None)
        if self.copy is not None:
            self.copy.barrier()


def _row_grads(param: torch.nn.Parameter) -> RowGradSum:
    """A device-placed table's row gradients of the step, with a sparse gradient set on
    the parameter directly (not by a backward: benchmarks) counted as one more backward."""
    row_grads = row_grads_of(param)
    row_grads.hook(param)
    return row_grads
