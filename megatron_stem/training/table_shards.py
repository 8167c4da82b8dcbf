"""Row shards of the STEM tables over data parallel: who owns, updates and sends which rows.

With `tables.partition: sharded` data-parallel rank r owns 1/n of the rows of every table
(of its tensor-parallel slice): only the owner keeps their fp32 master and Adam moments and
runs their update, so the CPU state and the CPU Adam work per rank are the whole table's /
n, as ZeRO-Offload does for dense parameters.

Which rows: shard r is positions [r*V/n, (r+1)*V/n) of `interleaved_order(V)`, a fixed
golden-ratio walk through the vocabulary. A BPE vocabulary is ordered roughly by merge
frequency, so contiguous id ranges would give the first rank most of the rows every step
touches (1.7x the mean Adam work at DP2, 2.7x at DP4 on the shipped corpus, and ~3x the
gradient rows to receive); every stretch of the walk samples the vocabulary evenly
instead. The order does not depend on n, so a shard is a contiguous range of one global
order: checkpoints store table states in that order and reshard to any data-parallel size.
A shard's local row k is table row `owned[k]`; local ids travel between the steps below.

Each step:
1. `to_owners`: every rank sends the rows it touched (its coalesced row gradients) to
   their owners in one all-to-all, in the training dtype; the owner sums them in fp32.
   Rows no rank touched send nothing (`dense` treats them as zero gradients).
2. the owner updates its rows (training/table_optim.py);
3. `gather` (device placement): every rank receives every owner's updated rows, cast to
   the table's dtype, straight into its table (an all-gather; `dense`: whole shards,
   `lazy`: the rows that changed). With host placement the owners write the node's shared
   copy, and only the copies on other nodes need the rows (`gather` over the cross-copy
   group): one copy per node stays the exact fp32 master.

The collectives run on the data-parallel group (gloo on CPU, NCCL on GPUs); byte counts
are kept per step in `TrafficCounters` (the trainer logs them, the step planner predicts
them with `megatron_stem/planning`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from megatron_stem.errors import ConfigError

ID_BYTES = 8  # int64 row ids and counts


@dataclass
class TrafficCounters:
    """What the table path moved in the last step, per rank (bytes or elements)."""

    grad_bytes: int = 0  # row gradients sent to other ranks (all-to-all or all-reduce)
    gather_bytes: int = 0  # updated rows received from other ranks
    index_bytes: int = 0  # row ids and counts exchanged
    grad_d2h_bytes: int = 0  # row gradients copied from the accelerator to the CPU
    update_h2d_bytes: int = 0  # updated rows copied from the CPU to the accelerator
    adam_elements: int = 0  # elements CPU Adam updated

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


class RowShards:
    """Equal row shards of a `vocab`-row table, one per rank of `group` (module docstring):
    this rank's local row k is table row `owned[k]`."""

    def __init__(self, vocab: int, group=None):
        self.group = group
        self.size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        if vocab % self.size:
            raise ConfigError(
                f"tables.partition: sharded splits the {vocab} table rows (the "
                f"vocabulary size) evenly over {self.size} data-parallel ranks, and {vocab} is "
                "not divisible by it; use a data-parallel size that divides it, or "
                "tables.partition=replicated")
        self.vocab, self.rows = vocab, vocab // self.size
        self.lo, self.hi = self.rank * self.rows, (self.rank + 1) * self.rows  # positions
        self.order = interleaved_order(vocab)  # position -> row id
        self.position = torch.empty_like(self.order)  # row id -> position
        self.position[self.order] = torch.arange(vocab)
        self.owned = self.order[self.lo:self.hi]
        self._on = {}  # device -> (order, position) there

    def _maps(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        device = torch.device(device)
        if device not in self._on:
            self._on[device] = (self.order.to(device), self.position.to(device))
        return self._on[device]

    def table_rows(self, local: torch.Tensor) -> torch.Tensor:
        """The table row ids of this shard's `local` rows."""
        return self._maps(local.device)[0][local + self.lo]

    # -- 1. row gradients to their owners -------------------------------------------------

    def to_owners(self, rows: torch.Tensor, values: torch.Tensor,
                  counters: TrafficCounters) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum every rank's row gradients on the rows' owners.

        `rows`: this rank's unique row ids; `values`: their gradients [rows, k] (any dtype:
        sent as is). Returns the owned rows that any rank touched (sorted local ids) and
        their summed gradients in fp32, both on `values`' device."""
        rows, order = self._by_position(rows)
        values = values[order]
        if self.size == 1:
            return rows - self.lo, values.float()
        incoming, send, recv = self._rows_to_owners(rows, counters)
        grads = torch.empty(sum(recv), values.shape[1], dtype=values.dtype, device=values.device)
        dist.all_to_all_single(grads, values.contiguous(), recv, send, group=self.group)
        counters.grad_bytes += (rows.numel() - send[self.rank]) * values.shape[1] * \
            values.element_size()
        owned, where = torch.unique(incoming - self.lo, return_inverse=True)
        # Summed in arrival order (rank 0's rows first), in fp32 whatever the wire dtype.
        summed = torch.zeros(owned.numel(), values.shape[1], dtype=torch.float32,
                             device=values.device)
        summed.index_add_(0, where, grads.float())
        return owned, summed

    def _by_position(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`rows` as sorted positions (so grouped by owner), and the order that sorts them."""
        positions, order = torch.sort(self._maps(rows.device)[1][rows])
        return positions, order

    def _rows_to_owners(self, positions: torch.Tensor, counters: TrafficCounters):
        """Send each of `positions` (sorted) to its owner: (the positions this rank
        received, rows sent to each rank, rows received from each rank)."""
        sent = torch.bincount(positions // self.rows, minlength=self.size)
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=self.group)
        send, recv = sent.tolist(), received.tolist()
        incoming = torch.empty(sum(recv), dtype=positions.dtype, device=positions.device)
        dist.all_to_all_single(incoming, positions, recv, send, group=self.group)
        counters.index_bytes += 2 * self.size * sent.element_size() + \
            (positions.numel() - send[self.rank]) * positions.element_size()
        return incoming, send, recv

    def needed_by_any(self, rows: torch.Tensor, counters: TrafficCounters) -> torch.Tensor:
        """The owned rows (sorted local ids) that any rank needs (`rows`: this rank's
        unique table row ids): an all-to-all of row ids, like `to_owners` without the
        gradients."""
        positions = self._by_position(rows)[0]
        if self.size == 1:
            return positions - self.lo
        return torch.unique(self._rows_to_owners(positions, counters)[0] - self.lo)

    # -- 3. updated rows to every holder --------------------------------------------------

    def gather_shards(self, table: torch.Tensor, shard: torch.Tensor | None, group,
                      counters: TrafficCounters) -> None:
        """Every rank of `group` holds `table` [V, w]; each contributes its updated shard
        (`shard`, [V/n, w] in local row order, any device/dtype; None: its rows are in
        its `table` already): afterwards every shard is in every table.

        `group` is the data-parallel group (device placement) or a cross-copy group
        (host placement: the ranks at this rank's index in every node's copy)."""
        peers = _group_ranks(group, self.group)
        order = self._maps(table.device)[0]
        if shard is None:
            if len(peers) == 1:
                return
            shard = table[order[self.lo:self.hi]]
        shard = _to_table(shard, table, counters)
        if len(peers) == 1:
            table.index_copy_(0, order[self.lo:self.hi], shard)
            return
        # One buffer per peer, not one for all: on the CPU a buffer over glibc's mmap
        # threshold (at most 32 MiB) is fresh pages every step, faulted in at a sixth of
        # the copy rate; smaller ones reuse the heap's.
        received = [torch.empty_like(shard) for _ in peers]
        dist.all_gather(received, shard.contiguous(), group=group)
        for r, rows in zip(peers, received):
            table.index_copy_(0, order[r * self.rows:(r + 1) * self.rows], rows)
        counters.gather_bytes += (len(peers) - 1) * shard.numel() * shard.element_size()

    def gather_rows(self, table: torch.Tensor, rows: torch.Tensor,
                    values: torch.Tensor | None, group, counters: TrafficCounters) -> None:
        """Like `gather_shards` for some of each owner's rows (`lazy`): `rows` (table row
        ids) with `values` (None: they are in its `table` already)."""
        peers = _group_ranks(group, self.group)
        device = table.device
        if values is None:
            if len(peers) == 1:
                return
            values = table[rows.to(device)]
        values = _to_table(values, table, counters)
        if len(peers) == 1:
            table.index_copy_(0, rows.to(device), values)
            return
        (ids, rows_in), longest = all_gather_padded([rows.to(device), values], group,
                                                    len(peers))
        counters.index_bytes += len(peers) * (ID_BYTES + longest * ID_BYTES)
        counters.gather_bytes += (len(peers) - 1) * longest * table.shape[1] * \
            values.element_size()
        for peer_ids, peer_rows in zip(ids, rows_in):  # no concatenated copy of them all
            table.index_copy_(0, peer_ids, peer_rows)

    def all_rows(self, rows: torch.Tensor, counters: TrafficCounters) -> torch.Tensor:
        """The union of every rank's (disjoint) owned `rows` (table row ids), sorted."""
        if self.size == 1:
            return rows.sort().values
        (gathered,), longest = all_gather_padded([rows], self.group, self.size)
        counters.index_bytes += self.size * (ID_BYTES + longest * ID_BYTES)
        return torch.cat(gathered).sort().values


def all_gather_padded(tensors: list[torch.Tensor], group, size: int):
    """Every rank's `tensors` (of one first-dimension length per rank, which may differ
    between ranks), all-gathered over `group` of `size` ranks, padded to the longest:
    per tensor, the ranks' tensors in rank order, trimmed; and the longest length."""
    length = tensors[0].shape[0]
    count = torch.tensor([length], device=tensors[0].device)
    counts = [torch.empty_like(count) for _ in range(size)]
    dist.all_gather(counts, count, group=group)
    counts = [int(c) for c in counts]
    longest = max(counts)
    out = []
    for t in tensors:
        padded = t.new_zeros((longest, *t.shape[1:]))
        padded[:length] = t
        gathered = [torch.empty_like(padded) for _ in range(size)]
        dist.all_gather(gathered, padded, group=group)
        out.append([g[:c] for g, c in zip(gathered, counts)])
    return out, longest


def _group_ranks(group, shard_group) -> list[int]:
    """The shard indices (ranks in the data-parallel group `shard_group`, None: the
    world) of `group`'s ranks, in `group`'s rank order; [this rank's] when `group` is
    None."""
    if not dist.is_initialized():
        return [0]
    if group is None:
        return [dist.get_rank(shard_group)]
    ranks = dist.get_process_group_ranks(group)
    return ranks if shard_group is None else [dist.get_group_rank(shard_group, g) for g in ranks]


def _to_table(rows: torch.Tensor, table: torch.Tensor, counters: TrafficCounters):
    """`rows` in `table`'s dtype (cast where they are: on the CPU before a copy to the
    accelerator, which then moves half the bytes of fp32 for bf16) and on its device."""
    rows = rows.to(table.dtype)
    if rows.device != table.device:
        counters.update_h2d_bytes += rows.numel() * rows.element_size()
        rows = rows.to(table.device, non_blocking=True)
    return rows
