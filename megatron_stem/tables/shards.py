"""Row ownership of the STEM tables: who owns, updates and sends which rows.

The rows of a table are split over the ranks of a group (`RowShards`): every
data-parallel rank (`tables.partition: sharded`), or the ranks sharing a node's host copy
(the shared copy's optimizer work). Only an owner keeps its rows' optimizer state (or
writes them in a shared copy) and runs their update, so CPU state and Adam work per rank
are the whole table's / n, as ZeRO-Offload does for dense parameters.

Which rows: shard r is positions [r*V/n, (r+1)*V/n) of `interleaved_order(V)`, a fixed
golden-ratio walk through the vocabulary. A BPE vocabulary is ordered roughly by merge
frequency, so contiguous id ranges would give the first rank most of the rows every step
touches (1.7x the mean Adam work at DP2, 2.7x at DP4 on the shipped corpus, and ~3x the
gradient rows to receive); every stretch of the walk samples the vocabulary evenly
instead. The order does not depend on n, so a shard is a contiguous range of one global
order: checkpoints store table states in that order (`ROW_ORDER` names it) and reshard to
any data-parallel size.

Index spaces, named apart everywhere in the tables' path:
* `ids`: table rows (vocabulary ids);
* `positions`: places in the walk (the checkpoint's row order);
* `local`: a shard's rows 0..V/n-1, the rows of its optimizer state: local k is position
  lo + k, table row `owned[k]`.

Each step of a sharded layout:
1. `to_owners`: every rank sends the rows it touched (its summed row gradients) to their
   owners in one all-to-all, in the training dtype; the owner sums them in fp32, in rank
   order (one `index_add_` per sender: no two additions to a row race on a GPU, so the
   bits do not depend on the device's scheduling).
2. the owner updates its rows (partition.py);
3. `gather_shards` / `gather_rows`: the holders of the table receive every owner's updated
   rows, cast to the table's dtype, straight into their tables (an all-gather; `dense`:
   whole shards, `lazy`: the rows that changed).
Every collective goes through a `Comm` (comm.py); byte counts are kept per step in
`TrafficCounters` (the trainer logs them, the step planner predicts them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from megatron_stem.runtime.errors import ConfigError, UserError
from megatron_stem.tables.comm import Comm, HostBuffers

ID_BYTES = 8  # int64 row ids and counts
# The row order of saved table states, a version number (the train state holds numbers
# only): 1, positions of `interleaved_order`'s golden-ratio walk. A change to the walk is
# a new number; a checkpoint saved in another order is refused (`check_row_order`).
ROW_ORDER = 1


@dataclass
class TrafficCounters:
    """What the table path moved in the last step, per rank (bytes or elements)."""

    grad_bytes: int = 0  # row gradients sent to other ranks (all-to-all or all-reduce)
    gather_bytes: int = 0  # updated rows received from other ranks
    index_bytes: int = 0  # row ids and counts exchanged
    grad_d2h_bytes: int = 0  # row gradients copied from the accelerator to the CPU
    update_h2d_bytes: int = 0  # updated rows copied from the CPU to the accelerator
    publish_d2h_bytes: int = 0  # gathered rows copied back into a host copy
    adam_elements: int = 0  # elements Adam updated

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, 0)

    @property
    def comm_bytes(self) -> int:
        return self.grad_bytes + self.gather_bytes + self.index_bytes

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)} | \
            {"comm_bytes": self.comm_bytes}


def interleaved_order(vocab: int) -> torch.Tensor:
    """Row ids in shard order: row (k * stride) mod `vocab` at position k, the stride near
    vocab / golden ratio and coprime with it (a permutation; any stretch of positions
    samples the ids evenly, low-discrepancy like the Weyl sequence k * 0.618 mod 1)."""
    stride = max(1, round(vocab / (1 + math.sqrt(5)) * 2))
    while math.gcd(stride, vocab) != 1:
        stride += 1
    return torch.arange(vocab, dtype=torch.long) * stride % vocab


def positions_in(rows: torch.Tensor, touched: torch.Tensor) -> torch.Tensor:
    """For each of `rows` (sorted), its index in `touched` (sorted), -1 if absent: where a
    row's gradient is among the touched rows' (a `dense` update's untouched rows: none)."""
    if not touched.numel():
        return torch.full_like(rows, -1)
    at = torch.searchsorted(touched, rows).clamp(max=touched.numel() - 1)
    return torch.where(touched[at] == rows, at, -1)


def earliest(rows: torch.Tensor, stages: torch.Tensor,
             count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct `rows` (sorted) and each one's smallest stage among `stages` (of
    `count`)."""
    distinct, inverse = torch.unique(rows, return_inverse=True)
    first = torch.full_like(distinct, count - 1).scatter_reduce_(0, inverse, stages, "amin")
    return distinct, first


def check_row_order(saved: int | None, where) -> None:
    """Refuse table states saved in another row order than `ROW_ORDER` (None: a
    checkpoint from before the order was recorded, which is this order)."""
    if saved is not None and saved != ROW_ORDER:
        raise UserError(f"{where}: its table optimizer states are in row order {saved}, this "
                        f"version reads order {ROW_ORDER}; resume it with the version that "
                        "saved it, or start from its weights (train.init_from)")


class RowShards:
    """Equal row shards of a `vocab`-row table, one per rank of `comm`'s group (module
    docstring): this rank's local row k is table row `owned[k]`."""

    def __init__(self, vocab: int, comm: Comm, what: str = "tables.partition: sharded"):
        self.comm = comm
        self.size, self.rank = comm.size, comm.rank
        if vocab % self.size:
            raise ConfigError(
                f"{what} splits the {vocab} table rows (the vocabulary size) evenly over "
                f"{self.size} ranks, and {vocab} is not divisible by it; use a "
                "data-parallel size that divides it, or tables.partition=replicated")
        self.vocab, self.rows = vocab, vocab // self.size
        self.lo, self.hi = self.rank * self.rows, (self.rank + 1) * self.rows  # positions
        self.order = interleaved_order(vocab)  # position -> id
        self.position = torch.empty_like(self.order)  # id -> position
        self.position[self.order] = torch.arange(vocab)
        self._on = {}  # device -> (order, position) there
        self._buffers = HostBuffers()  # the publication's, in a CPU run

    def _maps(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        device = torch.device(device)
        if device not in self._on:
            self._on[device] = (self.order.to(device), self.position.to(device))
        return self._on[device]

    def owned(self, device) -> torch.Tensor:
        """This shard's table rows, by local row."""
        return self._maps(device)[0][self.lo:self.hi]

    def ids_of(self, local: torch.Tensor) -> torch.Tensor:
        """The table rows of this shard's `local` rows."""
        return self._maps(local.device)[0][local + self.lo]

    def owner_of(self, ids: torch.Tensor) -> torch.Tensor:
        """The shard (rank in the group) that owns each of `ids`."""
        return self._maps(ids.device)[1][ids] // self.rows

    # -- 1. row gradients to their owners -------------------------------------------------

    def to_owners(self, ids: torch.Tensor, values: torch.Tensor,
                  counters: TrafficCounters) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum every rank's row gradients on the rows' owners.

        `ids`: this rank's unique table rows; `values`: their gradients [rows, k] (any
        dtype: sent as is), both on the accelerator. Returns the owned rows that any rank
        touched (sorted local rows) and their summed gradients in fp32, there too."""
        positions, order = self._by_position(ids)
        values = values[order]
        if self.size == 1:
            return positions - self.lo, values.float()
        incoming, send, recv = self._positions_to_owners(positions, counters)
        grads = torch.empty(sum(recv), values.shape[1], dtype=values.dtype,
                            device=values.device)
        self.comm.all_to_all(grads, values.contiguous(), recv, send)
        counters.grad_bytes += (positions.numel() - send[self.rank]) * values.shape[1] * \
            values.element_size()
        owned, where = torch.unique(incoming - self.lo, return_inverse=True)
        summed = torch.zeros(owned.numel(), values.shape[1], dtype=torch.float32,
                             device=values.device)
        for rows, part in zip(where.split(recv), grads.split(recv)):  # rank order
            summed.index_add_(0, rows, part.float())
        return owned, summed

    def _by_position(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`ids` as sorted positions (so grouped by owner), and the order that sorts them."""
        positions, order = torch.sort(self._maps(ids.device)[1][ids])
        return positions, order

    def _positions_to_owners(self, positions: torch.Tensor, counters: TrafficCounters,
                             per_position: int = 1):
        """Send each of `positions` (sorted) to its owner: (the positions this rank
        received, rows sent to each rank, rows received from each rank). `per_position`:
        the values are positions x `per_position` + a smaller tag."""
        owners = positions // (self.rows * per_position)  # (a bincount would read its max)
        sent = torch.zeros(self.size, dtype=owners.dtype, device=owners.device) \
            .scatter_add_(0, owners, torch.ones_like(owners))
        received = torch.empty_like(sent)
        self.comm.all_to_all(received, sent)
        sizes = torch.cat([sent, received]).tolist()  # what all_to_all takes: one host sync
        send, recv = sizes[:self.size], sizes[self.size:]
        incoming = torch.empty(sum(recv), dtype=positions.dtype, device=positions.device)
        self.comm.all_to_all(incoming, positions, recv, send)
        counters.index_bytes += 2 * self.size * sent.element_size() + \
            (positions.numel() - send[self.rank]) * positions.element_size()
        return incoming, send, recv

    def needed_by_any(self, ids: torch.Tensor, counters: TrafficCounters,
                      stages: torch.Tensor | None = None,
                      count: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """The owned rows (sorted local rows) that any rank needs, and for each the
        earliest of the `count` stages in which a rank needs it (`ids`: this rank's unique
        table rows, on the accelerator; `stages`: the stage in which this rank first needs
        each, 0 if not given): `to_owners` without the gradients, each position tagged
        with its stage (position x count + stage), so one exchange says both."""
        positions, order = self._by_position(ids)
        tagged = positions * count + (stages[order] if stages is not None else 0)
        if self.size > 1:
            tagged = self._positions_to_owners(tagged, counters, count)[0]
        return earliest(tagged // count - self.lo, tagged % count, count)

    # -- 3. updated rows to every holder --------------------------------------------------

    def gather_shards(self, table: torch.Tensor, shard: torch.Tensor | None, holders: Comm,
                      counters: TrafficCounters, on_host: bool = False) -> None:
        """Every rank of `holders` holds `table` [V, w]; each contributes its updated shard
        (`shard`, [V/n, w] by local row, any dtype, on the accelerator; None: its rows are
        in its `table` already): afterwards every shard is in every table.

        `holders` is the data-parallel group (device placement) or the copies' peers (host
        placement: the ranks at this rank's index in every node's copy, whose tables are
        host memory, `on_host`: the rows cross to the accelerator for the collective and
        back)."""
        peers = self._shard_indices(holders)
        order = self._maps(table.device)[0]
        into = _Into(holders.devices, on_host, counters)
        # Whether this rank's rows are in its table already: a table that is its own
        # master (updated in place), or a host copy (written by its owner).
        in_place = shard is None or on_host
        if shard is None:
            if len(peers) == 1:
                return
            shard = torch.index_select(table, 0, order[self.lo:self.hi], out=self._buffers.empty(
                "own", (self.rows, table.shape[1]), table.dtype, table.device))
        shard = holders.devices.to_accelerator(shard.to(table.dtype), counters,
                                               "update_h2d_bytes").contiguous()
        if len(peers) == 1:
            table.index_copy_(0, order[self.lo:self.hi], into(shard))
            return
        # One buffer per peer (an owner's rows are interleaved over the table, not one
        # slice of it); this rank's rows land in its own shard.
        received = [shard if r == self.rank else self._buffers.empty(
            ("peer", i), shard.shape, shard.dtype, shard.device) for i, r in enumerate(peers)]
        holders.all_gather(received, shard)
        for r, rows in zip(peers, received):
            if not (in_place and r == self.rank):
                table.index_copy_(0, order[r * self.rows:(r + 1) * self.rows], into(rows))
        counters.gather_bytes += (len(peers) - 1) * shard.numel() * shard.element_size()

    def gather_rows(self, table: torch.Tensor, ids: torch.Tensor,
                    values: torch.Tensor | None, holders: Comm,
                    counters: TrafficCounters, on_host: bool = False,
                    counts: list[int] | None = None) -> None:
        """Like `gather_shards` for some of each owner's rows (`lazy`): table rows `ids`
        with `values` (None: they are in its `table` already). `counts`: how many rows
        each of `holders`' ranks sends, when known (else exchanged: a host sync)."""
        peers = self._shard_indices(holders)
        devices = holders.devices
        into = _Into(devices, on_host, counters)
        values_given = values is not None
        if values is None:
            if len(peers) == 1:
                return
            values = table[into(ids, counted=False)]
        values = devices.to_accelerator(values.to(table.dtype), counters, "update_h2d_bytes")
        if len(peers) == 1:
            table.index_copy_(0, into(ids, counted=False), into(values))
            return
        (gathered_ids, gathered), longest = holders.all_gather_varying(
            [devices.to_accelerator(ids), values], counts)
        counters.index_bytes += len(peers) * (ID_BYTES + longest * ID_BYTES)
        counters.gather_bytes += (len(peers) - 1) * longest * table.shape[1] * \
            values.element_size()
        in_place = not values_given or on_host  # (as in `gather_shards`)
        for r, peer_ids, rows in zip(peers, gathered_ids, gathered):  # no copy of them all
            if not (in_place and r == self.rank):
                table.index_copy_(0, into(peer_ids, counted=False), into(rows))

    def all_ids(self, ids: torch.Tensor, counters: TrafficCounters) -> torch.Tensor:
        """The union of every shard's (disjoint) `ids` (table rows, on the accelerator),
        sorted."""
        if self.size == 1:
            return ids.sort().values
        (gathered,), longest = self.comm.all_gather_varying([ids])
        counters.index_bytes += self.size * (ID_BYTES + longest * ID_BYTES)
        return torch.cat(gathered).sort().values

    def _shard_indices(self, holders: Comm) -> list[int]:
        """The shard indices of `holders`' ranks, in their group's order."""
        if holders.size == 1:
            return [self.rank]
        index = {g: i for i, g in enumerate(self.comm.ranks())}
        return [index[g] for g in holders.ranks()]


class _Into:
    """Tensors to where a table is: the accelerator, or a host copy (`on_host`), whose
    gathered rows come back from the accelerator (counted in `publish_d2h_bytes`)."""

    def __init__(self, devices, on_host: bool, counters: TrafficCounters):
        self.devices, self.on_host, self.counters = devices, on_host, counters

    def __call__(self, tensor: torch.Tensor, counted: bool = True) -> torch.Tensor:
        if not self.on_host:
            return self.devices.to_accelerator(tensor)
        return self.devices.to_host(tensor, self.counters if counted else None,
                                    "publish_d2h_bytes")
