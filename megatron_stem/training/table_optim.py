"""The STEM tables' optimizer, ZeRO-Offload style, outside the DeepSpeed engine.

Why outside: DeepSpeed's ZeRO cannot take sparse gradients, and a dense gradient of all
tables (21 GB fp32 at 1B) per step would cost more than the whole backbone. So:

* the model's table parameters produce row-sparse gradients (`StemTable.sparse_grad`):
  only the rows of the micro-batches' token ids;
* `sync_grads` averages them over data parallel on the union of the ranks' rows (one
  all-reduce of `rows x width` per table), exactly like the engine averages dense grads;
* fp32 master weights and Adam moments live in CPU memory; DeepSpeed's CPU Adam kernel
  updates them and the changed rows are copied back into the model's table.

Host-resident tables (`tables.placement: host`, training/host_tables.py): the host table
IS the fp32 master (one copy per node, shared by the node's ranks, with its Adam moments).
The row gradients come from the store's staged rows instead of sparse grads, and the rows
are owned for the update: the ranks sharing a copy split its rows (`lazy`: row % ranks,
balanced under Zipfian ids; `dense`: contiguous ranges, so each update is one slice).
`sync_grads` reduces each row's gradient to its owner only (one reduce per owner over the
sharers: a reduce-scatter, in collectives gloo has too; then an all-reduce of the owned
rows among the owners of the same rows on other copies); the owner updates the shared
copy, so nothing is broadcast and no CPU work or memory is duplicated per GPU.

Update semantics (`TableOptimConfig.update`):
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

_kernel_ids = itertools.count(10_000)  # DeepSpeed keys CPU Adam instances by integer id
DENSE_CHUNK_BYTES = 64 << 20  # `dense` updates this many bytes of fp32 rows at a time


class AdamKernel:
    """In-place AdamW on contiguous fp32 CPU tensors: DeepSpeed's `cpu_adam` op, or the
    same arithmetic in torch where the op cannot be built (no compiler)."""

    def __init__(self, kind: str, betas: tuple[float, float], eps: float):
        self.betas, self.eps = betas, eps
        self.op = None
        if kind == "deepspeed":
            from deepspeed.ops.op_builder import CPUAdamBuilder

            self.op = CPUAdamBuilder().load()
            self.id = next(_kernel_ids)
            self.op.create_adam(self.id, 0.0, betas[0], betas[1], eps, 0.0, True, False)

    def update(self, step: int, lr: float, weight_decay: float, param: torch.Tensor,
               grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        b1, b2 = self.betas
        if self.op is not None:
            self.op.adam_update(self.id, step, lr, b1, b2, self.eps, weight_decay, True,
                                param, grad, exp_avg, exp_avg_sq)
            return
        param.mul_(1 - lr * weight_decay)
        exp_avg.lerp_(grad, 1 - b1)
        exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1 - b2)
        denom = (exp_avg_sq.sqrt() / math.sqrt(1 - b2 ** step)).add_(self.eps)
        param.addcdiv_(exp_avg, denom, value=-lr / (1 - b1 ** step))


@dataclass
class TableState:
    name: str
    param: torch.nn.Parameter  # the model's table (this TP rank's column slice)
    master: torch.Tensor  # fp32, CPU; the param itself when that is fp32 on CPU already
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    rows: torch.Tensor | None = None  # after sync_grads: touched rows (sorted, CPU)
    grad: torch.Tensor | None = None  # after sync_grads: their DP-averaged grads (CPU)
    dense_grad: torch.Tensor | None = None  # `dense` mode's reusable zero chunk

    @property
    def separate(self) -> bool:
        """Whether the model's table is a copy of the master that updates must reach (a
        GPU or bf16 table); an fp32 CPU table is the master itself. (`param.data` is a new
        tensor object at every access, so this compares memory, not objects.)"""
        return self.master.data_ptr() != self.param.data_ptr()


def _is_own_master(param: torch.nn.Parameter) -> bool:
    """An fp32 CPU table is its own fp32 master; any other gets a separate one."""
    return param.device.type == "cpu" and param.dtype == torch.float32


def cpu_state_bytes(tables: list[tuple[str, torch.nn.Parameter]]) -> int:
    """CPU memory a device-placement TableOptimizer allocates for `tables`: two fp32 Adam
    moments, and an fp32 master unless the table is its own."""
    return sum(p.numel() * 4 * (2 if _is_own_master(p) else 3) for _, p in tables)


class TableOptimizer:
    """`host`: the HostTableStore of host-resident tables (None: device-resident)."""

    def __init__(self, tables: list[tuple[str, torch.nn.Parameter]], update: str,
                 lr_mult: float, weight_decay: float, betas: tuple[float, float],
                 eps: float = 1e-8, kernel: str = "deepspeed", dp_group=None, tp_group=None,
                 host=None):
        if update not in ("dense", "lazy"):
            raise ValueError(f"unknown table update {update!r}")
        self.update_mode, self.lr_mult, self.weight_decay = update, lr_mult, weight_decay
        self.dp_group, self.tp_group = dp_group, tp_group
        self.host = host
        self.copy = host.copy if host is not None else None
        self.kernel = AdamKernel(kernel, betas, eps)
        self.step_count = 0
        self.tables = [self._state(name, p) for name, p in tables]
        self.last_comm_bytes = 0  # bytes sent over DP by the last sync_grads
        self.touched_rows = 0  # distinct rows in the last sync_grads (all DP ranks)
        self._step_rows = None  # host: the rows the step updates on the copy (all owners)

    def _state(self, name: str, param: torch.nn.Parameter) -> TableState:
        master = param.data if _is_own_master(param) \
            else param.detach().to("cpu", torch.float32).clone()
        if self.copy is not None:  # moments shared by the copy's ranks, like the table
            return TableState(name, param, master,
                              *(self.copy.tensor(f"{name}.{k}", tuple(master.shape))
                                for k in ("exp_avg", "exp_avg_sq")))
        return TableState(name, param, master, torch.zeros_like(master),
                          torch.zeros_like(master))

    # -- the host store's hand-offs -------------------------------------------------------

    def stage(self, microbatches: list[dict], requires_grad: bool = True) -> None:
        """Host tables: the micro-batches about to run, in order (training/host_tables.py).
        Nothing to do for device-resident tables."""
        if self.host is not None:
            self.host.stage(microbatches, requires_grad)

    def host_stats(self) -> dict[str, float]:
        return self.host.take_stats() if self.host is not None else {}

    def close(self) -> None:
        if self.host is not None:
            self.host.close()

    # -- gradients ----------------------------------------------------------------------

    def sync_grads(self) -> None:
        """Coalesce each table's sparse grad and average it over data parallel."""
        self.last_comm_bytes = 0
        if self.host is not None:
            self._sync_host_grads()
            return
        for t in self.tables:
            rows, values = _coalesced_rows(t.param)
            rows, values = self._average_over_dp(rows, values)
            t.rows, t.grad = rows.cpu(), values.to("cpu", torch.float32)
            t.param.grad = None
        # Every table sees the same ids: the first one's rows are the step's rows.
        self.touched_rows = self.tables[0].rows.numel() if self.tables else 0

    def _dp_world(self) -> int:
        return dist.get_world_size(self.dp_group) if dist.is_initialized() else 1

    def _union_over_dp(self, rows: torch.Tensor) -> torch.Tensor:
        """Sorted union of every DP rank's (sorted, unique) rows."""
        world = self._dp_world()
        if world == 1:
            return rows
        count = torch.tensor([rows.numel()], device=rows.device)
        counts = [torch.empty_like(count) for _ in range(world)]
        dist.all_gather(counts, count, group=self.dp_group)
        longest = int(max(c.item() for c in counts))
        padded = torch.full((longest,), -1, dtype=rows.dtype, device=rows.device)
        padded[:rows.numel()] = rows
        gathered = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(gathered, padded, group=self.dp_group)
        self.last_comm_bytes += world * padded.numel() * 8
        union = torch.unique(torch.cat(gathered))
        return union[union >= 0]

    def _average_over_dp(self, rows: torch.Tensor, values: torch.Tensor):
        world = self._dp_world()
        if world == 1:
            return rows, values
        union = self._union_over_dp(rows)
        summed = torch.zeros(union.numel(), values.shape[1], dtype=values.dtype,
                             device=values.device)
        summed[torch.searchsorted(union, rows)] = values
        dist.all_reduce(summed, group=self.dp_group)
        self.last_comm_bytes += summed.numel() * summed.element_size()
        return union, summed / world

    def _sync_host_grads(self) -> None:
        """Row grads from the staged rows, summed over DP onto each row's owner only."""
        rows, grads = self.host.take_row_grads()
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
            summed = torch.zeros(union.numel(), g.shape[1], dtype=g.dtype, device=device)
            summed[mine] = g
            chunks = summed.split(counts)
            if self.copy.group is not None:
                for j, chunk in enumerate(chunks):
                    if chunk.numel():
                        dist.reduce(chunk, dst=dist.get_global_rank(self.copy.group, j),
                                    group=self.copy.group)
                        self.last_comm_bytes += chunk.numel() * chunk.element_size()
            chunk = chunks[me]
            if self.copy.cross_group is not None:
                dist.all_reduce(chunk, group=self.copy.cross_group)
                self.last_comm_bytes += chunk.numel() * chunk.element_size()
            t.rows, t.grad = owned.cpu(), (chunk / world).to("cpu", torch.float32)
        self._step_rows = union.cpu()
        self.touched_rows = union.numel()

    def _owner(self, rows: torch.Tensor) -> torch.Tensor:
        """Which of the copy's ranks updates each row (host placement)."""
        if self.update_mode == "lazy":
            return rows % self.copy.size
        return rows * self.copy.size // self._vocab()

    def _owned_range(self) -> tuple[int, int]:
        """`dense`: this rank's contiguous rows [lo, hi) (all rows when not sharing)."""
        vocab = self._vocab()
        if self.copy is None:
            return 0, vocab
        size, me = self.copy.size, self.copy.index
        return -(-me * vocab // size), -(-(me + 1) * vocab // size)

    def _vocab(self) -> int:
        return self.tables[0].master.shape[0]

    def grad_norm_sq(self) -> float:
        """Squared L2 norm of all table grads (after `sync_grads`), summed over TP slices
        (and over the owners of a shared host copy, each holding its rows' grads)."""
        local = torch.tensor(sum(float(t.grad.double().square().sum()) for t in self.tables),
                             dtype=torch.float64)
        groups = [self.tp_group]
        if self.copy is not None:
            groups.append(self.copy.group)
        groups = [g for g in groups if g is not None]
        if dist.is_initialized() and groups:
            local = local.to(parallel.device())
            for group in groups:
                dist.all_reduce(local, group=group)
        return float(local)

    # -- update -------------------------------------------------------------------------

    def step(self, lr: float, clip_coef: float = 1.0) -> None:
        if self.host is not None:
            self.host.wait_idle()  # nothing may read a table while it is written
        self.step_count += 1
        lr = lr * self.lr_mult
        for t in self.tables:
            grad = t.grad * clip_coef if clip_coef != 1.0 else t.grad
            if self.update_mode == "dense":
                self._dense_update(t, grad, lr)
            else:
                self._lazy_update(t, grad, lr)
            t.rows = t.grad = None
        if self.host is not None:
            self.copy.barrier()  # every owner has written its rows of the shared copy
            self.host.rows_changed(self._step_rows if self.update_mode == "lazy" else None)

    def _dense_update(self, t: TableState, grad: torch.Tensor, lr: float) -> None:
        """AdamW over the owned rows, a chunk of rows at a time: the zero gradient of the
        untouched rows is a chunk-sized buffer, not a [V, w] one (21 GB fp32 at 1B)."""
        lo, hi = self._owned_range()
        chunk = max(1, DENSE_CHUNK_BYTES // (4 * t.master.shape[1]))
        if t.dense_grad is None:
            t.dense_grad = torch.zeros(min(chunk, hi - lo), t.master.shape[1])
        bounds = torch.searchsorted(t.rows, torch.arange(lo, hi + chunk, chunk).clamp(max=hi))
        for start, a, b in zip(range(lo, hi, chunk), bounds[:-1].tolist(), bounds[1:].tolist()):
            end = min(start + chunk, hi)
            zeros = t.dense_grad[:end - start]  # leading rows: contiguous, as the kernel needs
            local = t.rows[a:b] - start
            zeros.index_copy_(0, local, grad[a:b])
            self.kernel.update(self.step_count, lr, self.weight_decay, t.master[start:end],
                               zeros, t.exp_avg[start:end], t.exp_avg_sq[start:end])
            zeros.index_fill_(0, local, 0)  # back to all zeros for the next chunk
        if t.separate:
            t.param.data.copy_(t.master, non_blocking=True)

    def _lazy_update(self, t: TableState, grad: torch.Tensor, lr: float) -> None:
        rows = t.rows
        if rows.numel() == 0:
            return
        # Gather the touched rows into contiguous buffers (the kernel needs contiguous
        # memory), update them, scatter back.
        param, m, v = (x.index_select(0, rows) for x in (t.master, t.exp_avg, t.exp_avg_sq))
        self.kernel.update(self.step_count, lr, self.weight_decay, param,
                           grad.contiguous(), m, v)
        for dst, src in ((t.master, param), (t.exp_avg, m), (t.exp_avg_sq, v)):
            dst.index_copy_(0, rows, src)
        if t.separate:
            t.param.data.index_copy_(0, rows.to(t.param.device),
                                     param.to(t.param.device, t.param.dtype))

    # -- checkpoint ---------------------------------------------------------------------

    def state_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """{table name: {"fp32_param", "exp_avg", "exp_avg_sq"}}, this rank's slices."""
        return {t.name: {"fp32_param": t.master, "exp_avg": t.exp_avg,
                         "exp_avg_sq": t.exp_avg_sq} for t in self.tables}

    def load_state_tensors(self, states: dict[str, dict[str, torch.Tensor]], step: int) -> None:
        self.step_count = step
        if self.host is not None:
            self.host.invalidate()
        writer = self.copy is None or self.copy.index == 0  # one writer per shared copy
        for t in self.tables:
            s = states[t.name]
            if writer:
                t.master.copy_(s["fp32_param"])
                t.exp_avg.copy_(s["exp_avg"])
                t.exp_avg_sq.copy_(s["exp_avg_sq"])
            if t.separate:
                t.param.data.copy_(t.master)
        if self.copy is not None:
            self.copy.barrier()


def _coalesced_rows(param: torch.nn.Parameter) -> tuple[torch.Tensor, torch.Tensor]:
    grad = param.grad
    width = param.shape[1]
    if grad is None:
        return (torch.empty(0, dtype=torch.long, device=param.device),
                torch.empty(0, width, dtype=torch.float32, device=param.device))
    if not grad.is_sparse:
        raise RuntimeError(f"table grad is dense: set StemTable.sparse_grad = True "
                           f"({tuple(param.shape)})")
    grad = grad.coalesce()
    return grad.indices()[0], grad.values().float()
