"""A device-resident cache of the most frequent rows of STEM tables (LFU with aging).

The hot-row cache of the trainer's host-resident tables (`tables/host_tables.py`) and of
the Hugging Face model's (decoding serves hot rows from it): every export bundles this
file next to its model code (`hf/export.py`), so it imports only torch.
"""

import torch


class RowCache:
    """`capacity` rows of each of several tables that share one id space (the STEM tables
    of a model: every table is indexed by the same token id), kept on the tables' devices.

    Membership is LFU with aging. An id's frequency counts the batches it appeared in
    (`observe`), and every `plan()` multiplies all frequencies by `decay`. `plan()` makes
    the members the `capacity` most frequent ids among the current members and the ids
    observed since the previous plan: every other id only decayed like the members did, so
    this keeps the members the most frequent ids of all, at a cost that follows the batches,
    not the vocabulary. Ties keep the member (no churn). Aging lets a cache follow data
    whose hot ids drift; measured on real text (bench/host_tables.py) the default 0.99 per
    plan is within a point of pure LFU and of a static top-k oracle, and LRU is far behind.

    The cache never reads a table: `plan()` says which slots got a new id and the caller
    writes their rows (`write`), as it does for members whose rows changed (`slots`), at a
    point where it knows the table is not being written (the trainer: after the optimizer
    step). Bookkeeping is on the CPU, next to the host tables; only `rows` are on devices.
    """

    def __init__(self, num_ids: int, capacity: int, widths: list[int], dtype: torch.dtype,
                 devices: list[torch.device], decay: float = 0.99):
        if capacity <= 0 or capacity > num_ids:
            raise ValueError(f"cache capacity {capacity} must be in [1, {num_ids}]")
        self.capacity, self.decay = capacity, decay
        self.slot_of = torch.full((num_ids,), -1, dtype=torch.long)  # id -> slot, -1: absent
        self.id_of = torch.full((capacity,), -1, dtype=torch.long)  # slot -> id, -1: free
        self.freq = torch.zeros(num_ids, dtype=torch.float32)
        self._seen: list[torch.Tensor] = []  # ids observed since the last plan
        self.rows = [torch.zeros(capacity, w, dtype=dtype, device=d)
                     for w, d in zip(widths, devices)]

    def observe(self, unique_ids: torch.Tensor) -> None:
        """Count one batch's (deduplicated) ids."""
        self.freq.index_add_(0, unique_ids, torch.ones(unique_ids.numel()))
        self._seen.append(unique_ids)

    def slots(self, ids: torch.Tensor) -> torch.Tensor:
        """The slot of each id, -1 where it is not cached."""
        return self.slot_of[ids]

    def occupied(self) -> torch.Tensor:
        return (self.id_of >= 0).nonzero().flatten()

    def plan(self) -> torch.Tensor:
        """Update membership; returns the slots that now hold another id (rows to write)."""
        seen = torch.unique(torch.cat(self._seen)) if self._seen else self.id_of[:0]
        self._seen = []
        candidates = seen[self.slot_of[seen] < 0]
        if candidates.numel() == 0:  # every id seen is a member (decoding, mostly)
            self.freq.mul_(self.decay)
            return self.id_of[:0]
        members = self.id_of[self.id_of >= 0]
        pool = torch.cat([members, candidates])  # members first: a stable sort keeps them on ties
        order = torch.sort(self.freq[pool], descending=True, stable=True).indices
        keep = torch.zeros(pool.numel(), dtype=torch.bool)
        keep[order[:self.capacity]] = True
        evicted, admitted = members[~keep[:members.numel()]], candidates[keep[members.numel():]]
        free = torch.cat([(self.id_of < 0).nonzero().flatten(), self.slot_of[evicted]])
        self.id_of[self.slot_of[evicted]] = -1
        self.slot_of[evicted] = -1
        slots = free[:admitted.numel()]
        self.slot_of[admitted] = slots
        self.id_of[slots] = admitted
        self.freq.mul_(self.decay)
        return slots

    def assemble(self, table: int, hit_at: torch.Tensor, hit_slots: torch.Tensor,
                 miss_at: torch.Tensor, missed: torch.Tensor) -> torch.Tensor:
        """Table `table`'s rows for a list of ids: the cached rows of slots `hit_slots` at
        positions `hit_at`, the rows `missed` (fetched elsewhere) at `miss_at`. Indices are
        on the table's device; index copies, no boolean masks (they would sync the host)."""
        cached = self.rows[table]
        rows = torch.empty(hit_at.numel() + miss_at.numel(), cached.shape[1],
                           dtype=cached.dtype, device=cached.device)
        rows.index_copy_(0, hit_at, cached.index_select(0, hit_slots))
        rows.index_copy_(0, miss_at, missed)
        return rows

    def write(self, table: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """rows[i] becomes table `table`'s row in slot slots[i] (rows on its device)."""
        cached = self.rows[table]
        cached.index_copy_(0, slots.to(cached.device, non_blocking=True), rows)

    def clear(self) -> None:
        self.slot_of.fill_(-1)
        self.id_of.fill_(-1)
