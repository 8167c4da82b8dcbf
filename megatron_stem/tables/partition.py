"""Who keeps and updates which rows of the tables' optimizer state: one class per way.

* `Replicated` (device tables, `partition: replicated`): every data-parallel rank keeps
  the whole state and runs the whole update; gradients are all-reduced on the union of the
  ranks' rows. The reference the others are tested against.
* `SharedHostCopy` (host tables, `replicated`): one copy per node, shared by its ranks
  (model/host_copy.py): the host table is the fp32 master and the moments are shared too;
  the copy's ranks split its rows (`RowShards` over them). Each row's gradient is reduced
  to its owner on the copy, then all-reduced among the owners of that row on the other
  copies; the owner writes the copy in place, so nothing is published.
* `RowSharded` (`sharded`, either placement): each data-parallel rank owns 1/n of the rows
  (shards.py): gradients go to the owners, updated rows to the holders of the table (every
  rank's device table, or the other nodes' host copies: the owners write their own copy).

What `optimizer.TableOptimizer` calls, in the index spaces of shards.py (`local`: the rows
of this rank's optimizer state; `ids`: table rows):
  make_state(name, param)        -> TableState
  sync(ids, grads, counters)     -> (touched local rows this rank updates, sorted; their
                                     fp32 gradients averaged over data parallel; rows
                                     touched on all ranks: an int, or a device tensor for
                                     the step's host read), on the accelerator
  ids_of(local)                  -> their table rows
  dense_rows(device)             -> every local row this rank updates under `dense`
  norm_comm                      -> the ranks holding disjoint rows' gradients (None: all
                                     are here)
  publish(t, local, values, c)   -> updated rows (`local`; None: all of `dense_rows`;
                                     `values` in the table's dtype, None: read them from
                                     the table) to every holder of the table
  changed_ids(local, c)          -> host tables: the rows the step changed on this copy
  checkpoint_rows(t)             -> {state: (live tensor, its rows in checkpoint order)}
  writes_on_load, sends_rows, state_sharers, shard, barrier()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_stem.tables.comm import Comm, Devices, mark_host
from megatron_stem.tables.shards import ID_BYTES, RowShards, interleaved_order


@dataclass
class TableState:
    name: str
    param: torch.nn.Parameter  # the model's table (this TP rank's column slice)
    master: torch.Tensor  # fp32, where the state is; the table itself when it is its own
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    # Whether the model's table is a copy of the master that updates must reach (a bf16
    # or accelerator table); an fp32 table where the state lives is its own master.
    separate: bool
    # The master rows of the state's local rows: None when they are the same (a separate
    # master of this rank's rows); table rows when the master is the whole table.
    master_rows: Optional[torch.Tensor] = None
    rows: Optional[torch.Tensor] = None  # after sync: touched local rows (sorted)
    grad: Optional[torch.Tensor] = None  # after sync: their averaged gradients, fp32
    values: Optional[torch.Tensor] = None  # updated rows in the table's dtype (a buffer)

    def master_index(self, local: torch.Tensor) -> torch.Tensor:
        return local if self.master_rows is None else self.master_rows[local]


def cpu_state_bytes(tables: list[tuple[str, torch.nn.Parameter]], shards: int = 1) -> int:
    """CPU memory a device-placement TableOptimizer allocates for `tables` on each rank:
    two fp32 Adam moments, and an fp32 master unless the table is its own (an fp32 table
    in CPU memory), of 1/`shards` of the rows (`partition: sharded` over that many
    data-parallel ranks)."""
    def own(p):
        return p.device.type == "cpu" and p.dtype == torch.float32
    return sum(p.numel() * 4 * (2 if own(p) else 3) for _, p in tables) // shards


class Partition:
    """What the three partitions share (module docstring for the interface)."""

    shard: Optional[tuple[int, int, int, int]] = None  # checkpoint: (first position, rows,
    # shards, index) of the state rows held here; None: whole tables
    norm_comm: Optional[Comm] = None
    writes_on_load = True
    sends_rows = False  # whether `publish` sends a separate table's updated rows (values)
    state_sharers = 1  # ranks whose one state this is (a shared host copy's)

    def __init__(self, vocab: int, devices: Devices, state_on_host: bool, dp: Comm):
        self.vocab, self.devices, self.state_on_host, self.dp = vocab, devices, \
            state_on_host, dp

    def _state_zeros(self, shape) -> torch.Tensor:
        if self.state_on_host:
            return self.devices.host_zeros(shape)
        return torch.zeros(shape, device=self.devices.accelerator)

    def _own_master(self, param: torch.nn.Parameter) -> bool:
        """An fp32 table in the state's memory is its own master."""
        in_state_memory = not self.devices.separate or \
            (param.device.type == "cpu") == self.state_on_host
        return in_state_memory and param.dtype == torch.float32

    def _master_copy(self, param: torch.nn.Parameter, ids=None) -> torch.Tensor:
        rows = param.detach() if ids is None else param.detach()[ids]
        if self.state_on_host:
            return self.devices.to_host(rows.float()).clone()
        return rows.to(self.devices.accelerator, torch.float32).clone()

    def _union(self, ids: torch.Tensor, counters) -> torch.Tensor:
        """Sorted union of every data-parallel rank's (sorted, unique) `ids`."""
        if self.dp.size == 1:
            return ids
        (gathered,), longest = self.dp.all_gather_varying([ids])
        counters.index_bytes += self.dp.size * longest * ID_BYTES
        return torch.unique(torch.cat(gathered))

    def ids_of(self, local: torch.Tensor) -> torch.Tensor:
        return local

    def dense_rows(self, device) -> torch.Tensor:
        return torch.arange(self.vocab, device=device)

    def changed_ids(self, local, counters) -> Optional[torch.Tensor]:
        return None

    def barrier(self) -> None:
        pass

    def checkpoint_rows(self, t: TableState) -> dict:
        """Whole tables, kept by table row: in checkpoint order through the walk."""
        order = interleaved_order(self.vocab)
        return {key: (live, order.to(live.device)) for key, live in
                (("fp32_param", t.master), ("exp_avg", t.exp_avg),
                 ("exp_avg_sq", t.exp_avg_sq))}


class Replicated(Partition):
    def make_state(self, name: str, param: torch.nn.Parameter) -> TableState:
        own = self._own_master(param)
        master = param.data if own else self._master_copy(param)
        return TableState(name, param, master, self._state_zeros(master.shape),
                          self._state_zeros(master.shape), separate=not own)

    def sync(self, ids, grads, counters):
        union = self._union(ids, counters)
        place = torch.searchsorted(union, ids)
        averaged = []
        for g in grads:
            summed = torch.zeros(union.numel(), g.shape[1], device=g.device)
            summed[place] = g.float()
            if self.dp.size > 1:
                self.dp.all_reduce(summed)
                counters.grad_bytes += summed.numel() * summed.element_size()
            averaged.append(summed / self.dp.size)
        return union, averaged, union.numel()

    def publish(self, t: TableState, local, values, counters, holders=None) -> None:
        """This rank's master has every row: only a separate table needs them."""
        if not t.separate:
            return
        if local is None:  # fp32 crosses, cast on the accelerator
            if self.devices.separate:
                counters.update_h2d_bytes += t.master.numel() * t.master.element_size()
            t.param.data.copy_(t.master, non_blocking=True)
            return
        t.param.data.index_copy_(0, self.devices.to_accelerator(local),
                                 self.devices.to_accelerator(values, counters,
                                                             "update_h2d_bytes"))


class SharedHostCopy(Partition):
    def __init__(self, vocab, devices, dp: Comm, copy, copy_comm: Comm, cross: Comm):
        super().__init__(vocab, devices, True, dp)
        self.copy, self.cross = copy, cross
        self.owners = RowShards(vocab, copy_comm, "a host copy's ranks")
        self.norm_comm = copy_comm if copy.size > 1 else None
        self.writes_on_load = copy.index == 0  # one writer per shared copy
        self.state_sharers = copy.size
        self._step_ids = None

    def make_state(self, name: str, param: torch.nn.Parameter) -> TableState:
        mark_host(param)
        moments = [mark_host(self.copy.tensor(f"{name}.{k}", tuple(param.shape)))
                   for k in ("exp_avg", "exp_avg_sq")]
        return TableState(name, param, param.data, *moments, separate=False)

    def sync(self, ids, grads, counters):
        """Each row's gradient summed onto its owner among the copy's ranks (one reduce
        per owner: a reduce-scatter in collectives gloo has too), then over the copies."""
        union = self._union(ids, counters)
        owner = self.owners.owner_of(union)
        by_owner = torch.sort(owner, stable=True).indices  # ascending rows per owner
        counts = torch.bincount(owner, minlength=self.copy.size).tolist()
        place = torch.empty_like(by_owner)
        place[by_owner] = torch.arange(by_owner.numel(), device=by_owner.device)
        mine = place[torch.searchsorted(union, ids)]
        me = self.copy.index
        start = sum(counts[:me])
        owned = union[by_owner][start:start + counts[me]]
        averaged = []
        for g in grads:  # summed over the ranks in fp32, like `Replicated.sync`
            summed = torch.zeros(union.numel(), g.shape[1], device=g.device)
            summed[mine] = g.float()
            chunks = summed.split(counts)
            if self.copy.size > 1:
                for j, chunk in enumerate(chunks):
                    if chunk.numel():
                        self.owners.comm.reduce(chunk, j)
                        counters.grad_bytes += chunk.numel() * chunk.element_size()
            chunk = chunks[me]
            if self.cross.size > 1:
                self.cross.all_reduce(chunk)
                counters.grad_bytes += chunk.numel() * chunk.element_size()
            averaged.append(chunk / self.dp.size)
        self._step_ids = union
        return owned, averaged, union.numel()

    def dense_rows(self, device) -> torch.Tensor:
        return self.owners.owned(device).sort().values

    def publish(self, t, local, values, counters, holders=None) -> None:
        """The owners write the copy in place (every copy runs the whole update)."""

    def changed_ids(self, local, counters):
        """Every copy runs the whole update: the step's union changed (`dense`: all)."""
        return None if local is None else self._step_ids

    def barrier(self) -> None:
        self.copy.barrier()  # every owner has written its rows of the shared copy


class RowSharded(Partition):
    """`holders`: the ranks whose tables need this rank's updated rows: every
    data-parallel rank's device table, or (`copy` given: host tables) the other copies'
    peers of this rank (its own copy has them: the master is a slice of it)."""

    sends_rows = True

    def __init__(self, vocab, devices, state_on_host: bool, dp: Comm, holders: Comm,
                 copy=None):
        super().__init__(vocab, devices, state_on_host, dp)
        self.shards = RowShards(vocab, dp)
        self.holders, self.copy = holders, copy
        self.norm_comm = dp if dp.size > 1 else None
        s = self.shards
        self.shard = (s.lo, s.rows, s.size, s.rank)

    @property
    def on_host(self) -> bool:
        return self.copy is not None

    def make_state(self, name: str, param: torch.nn.Parameter) -> TableState:
        shape = (self.shards.rows, param.shape[1])
        moments = [self._state_zeros(shape) for _ in range(2)]
        if self.on_host:
            mark_host(param)
        if self.on_host or self._own_master(param):  # updated in place in the table
            return TableState(name, param, param.data, *moments, separate=False,
                              master_rows=self.shards.owned(param.device))
        master = self._master_copy(param, self.shards.owned(param.device))
        return TableState(name, param, master, *moments, separate=True)

    def sync(self, ids, grads, counters):
        width = grads[0].shape[1]
        local, summed = self.shards.to_owners(ids, torch.cat(grads, 1), counters)
        summed = summed / self.dp.size
        count = torch.full((1,), local.numel(), device=self.devices.accelerator)
        if self.dp.size > 1:
            self.dp.all_reduce(count)
        return local, list(summed.split(width, 1)), count  # read with the step's values

    def ids_of(self, local: torch.Tensor) -> torch.Tensor:
        return self.shards.ids_of(local)

    def dense_rows(self, device) -> torch.Tensor:
        return torch.arange(self.shards.rows, device=device)

    def publish(self, t, local, values, counters, holders: Comm | None = None,
                counts: list[int] | None = None) -> None:
        """`holders`: another group over the same ranks (the overlapped update's);
        `counts`: how many of `local`'s rows each of them sends, when known."""
        holders = holders or self.holders
        if local is None:
            self.shards.gather_shards(t.param.data, values, holders, counters, self.on_host)
        else:
            self.shards.gather_rows(t.param.data, self.ids_of(local), values, holders,
                                    counters, self.on_host, counts)

    def changed_ids(self, local, counters):
        if local is None:
            return None
        return self.shards.all_ids(self.devices.to_accelerator(self.ids_of(local)), counters)

    def barrier(self) -> None:
        if self.copy is not None:
            self.copy.barrier()

    def checkpoint_rows(self, t: TableState) -> dict:
        """This shard's rows, kept by local row: checkpoint order already."""
        return {"fp32_param": (t.master, t.master_rows), "exp_avg": (t.exp_avg, None),
                "exp_avg_sq": (t.exp_avg_sq, None)}
