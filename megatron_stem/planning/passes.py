"""The tables' work at the step boundary on the rank's own memory, op by op as the code runs
it: bytes read + written, and host syncs (an op whose result size or value the host needs:
`torch.unique`, `.tolist()`, `int()`, `float()` of a device tensor).

`traffic.py` counts what crosses between ranks or memories (the trainer's counters); this
module counts what the same path does in place, per rank per step, all tables:

* `collect_*`: tables/row_grads.py `RowGradSum`, per table: each micro-batch's sparse
  gradient upcast to fp32 (bf16 training; a no-op in fp32) and summed per row by
  `embedding_dense_backward` over its rows (known from the host's ids, `StepRows`: no
  `unique`, no sync), their sums `index_add_`-ed into the step's union in fp32, then cast
  once to the training dtype; `take_same_rows` reads whether every position's row was a
  staged one (one sync, all tables).
* `pack_*`: `RowSharded.sync` (shards.py `to_owners`): the tables' grads concatenated,
  sorted by owner (a gather), the counts exchanged (`.tolist()`), the received rows
  upcast and `index_add_`-ed in fp32 per sender after a `unique`, averaged into a new
  buffer, the touched-row count all-reduced (`int`). `Replicated.sync`: the ids all-gathered
  (`int` of each rank's count), their `unique`, then per table a zero union buffer, this
  rank's rows placed into it in fp32, all-reduced, averaged into a new one.
* `finite_bytes`: `TableOptimizer.sync_grads`' finite check of the rank's own row grads
  (`all_finite`: one `aminmax` each).
* `norm_bytes`: each owned row's sum of squares in float64 (`double`, `square`, `sum(1)`),
  on the accelerator, before the grads leave it.
* `split_bytes`: sharded grads are one [rows, tables x width] tensor; each table's slice is
  made contiguous before it is handed to the state (`g.contiguous()`).
* `norm_rows_bytes`, `norm_reduce_bytes`: `grad_norm_sq` (in DeepSpeed's step): the
  rows' squares placed in a zeroed [vocabulary, tables] fp64 array, all-reduced over the
  holders of disjoint rows, summed (read with the step's other values: one sync).
* `placed_bytes`, `place_bytes`: the sharded publication's placing of the gathered rows
  into the table (`index_copy_`), and the own rows gathered out of a table that is its own
  master (`index_select`).
* `launch_*`: `next_step`'s split of the update (`_launch_overlapped`): the next step's ids'
  `unique` (on the host), the owners' `needed_by_any` (counts `.tolist()`, positions
  tagged with their stage, `unique`), the needed rows and stages copied to the state's
  memory, the rows split by stage once for all tables.
"""

from __future__ import annotations

from megatron_stem.planning.traffic import FP32, Layout, RowCounts, TableShape


def collect_bytes(shape: TableShape, tokens: int, counts: RowCounts, dtype_bytes: int) -> float:
    """RowGradSum.take over the step's `tokens` positions, all tables."""
    w, t = shape.width, shape.tables
    upcast = tokens * w * (dtype_bytes + FP32) if dtype_bytes != FP32 else 0
    sums = tokens * w * FP32 + counts.microbatch_rows * w * 2 * FP32  # read; zero + write
    union = counts.rank_rows * w * FP32  # zeros
    add = counts.microbatch_rows * w * 3 * FP32  # read the part; read + write the total
    cast = counts.rank_rows * w * (FP32 + dtype_bytes) if dtype_bytes != FP32 else 0
    return t * (upcast + sums + union + add + cast)


COLLECT_SYNCS = 1  # the staged-rows check, read once for all tables


def pack_bytes(shape: TableShape, layout: Layout, counts: RowCounts) -> float:
    """The grads' way to the rows' owners on this rank's memory, all tables."""
    w, t, b = shape.width, shape.tables, layout.grad_bytes
    if layout.partition == "sharded":
        rows = counts.rank_rows * w * t
        cat_sort = 2 * rows * 2 * b  # concatenated, then gathered into owner order
        if layout.dp == 1:
            return cat_sort + (rows * (b + FP32) if b != FP32 else 0)
        owned = counts.owned_rows * w * t
        received = rows  # as many rows arrive as leave, on average
        upcast = received * (b + FP32) if b != FP32 else 0
        summed = owned * FP32 + received * 3 * FP32
        return cat_sort + upcast + summed + 2 * owned * FP32  # ... and averaged
    # Replicated, and a host copy's ranks (SharedHostCopy: the same buffers, reduced in
    # owners' chunks)
    union = counts.union_rows * w * t
    placed = counts.rank_rows * w * t * (b + FP32)
    return union * FP32 + placed + 2 * union * FP32  # zeros, placed, averaged


def pack_syncs(layout: Layout) -> int:
    if layout.dp == 1:
        return 0
    if layout.partition == "sharded":
        return 3  # counts' tolist, the received rows' unique, the touched count's int
    return 2  # the ranks' id counts, their union's unique


def finite_bytes(shape: TableShape, counts: RowCounts, dtype_bytes: int) -> float:
    """The rank's own row grads read once (`optimizer.all_finite`: their min and max)."""
    return counts.rank_rows * shape.width * shape.tables * dtype_bytes


def norm_elements(shape: TableShape, layout: Layout, counts: RowCounts) -> float:
    """Elements whose squares this rank takes: the rows it updates that were touched."""
    rows = counts.union_rows if layout.sharers == 1 else counts.owned_rows
    return rows * shape.width * shape.tables


NORM_BYTES_PER_ELEMENT = FP32 + 8 + 8 + 8 + 8  # double (read 4, write 8), square, sum


def norm_bytes(shape: TableShape, layout: Layout, counts: RowCounts) -> float:
    return norm_elements(shape, layout, counts) * NORM_BYTES_PER_ELEMENT


def split_bytes(shape: TableShape, layout: Layout, counts: RowCounts) -> float:
    """Sharded: each table's slice of the owners' sums copied out contiguous."""
    if layout.partition != "sharded" or shape.tables < 2:
        return 0.0
    return 2 * norm_elements(shape, layout, counts) * FP32


def norm_holders(layout: Layout) -> int:
    """The ranks over which `grad_norm_sq` all-reduces the rows' squares: those that hold
    disjoint rows' grads (1: every rank holds them all)."""
    return layout.dp if layout.partition == "sharded" else (
        layout.ranks_per_copy if layout.placement == "host" else 1)


def norm_rows_bytes(shape: TableShape) -> float:
    """`grad_norm_sq`'s [vocabulary, tables] array of the rows' squares (fp64)."""
    return shape.rows * shape.tables * 8


def norm_reduce_bytes(shape: TableShape, layout: Layout) -> float:
    """All-reduced by this rank in `grad_norm_sq`: the whole array of the rows' squares."""
    return norm_rows_bytes(shape) if norm_holders(layout) > 1 else 0.0


def own_shard_bytes(layout: Layout, gathered: float) -> float:
    """Of a sharded publication that received `gathered` bytes from the other owners, this
    rank's own share (the owners' shards are equal)."""
    return gathered / max(layout.dp - 1, 1)


def placed_bytes(layout: Layout, gathered: float) -> float:
    """Sharded publication (shards.py `gather_shards`/`gather_rows`): the row bytes put into
    this rank's table by `index_copy_`, of the `gathered` bytes received from the other
    owners (an owner's rows are interleaved over the table, not one slice of it), and this
    rank's own updated rows unless the table is its own master (updated in place)."""
    return gathered + (0 if layout.own_master else own_shard_bytes(layout, gathered))


def place_bytes(layout: Layout, gathered: float) -> float:
    """Read + written by the placing: the other owners' rows put in, and this rank's own
    rows touched once either way: put in (a separate table) or gathered out for the
    collective (a table that is its own master, `index_select`)."""
    return 2 * (gathered + own_shard_bytes(layout, gathered))


def launch_syncs(layout: Layout) -> int:
    """`next_step`'s launch of the overlapped update: the owners' counts read (`tolist`,
    DP > 1) and their `unique`; then CPU state's one copy of the needed rows and stages to
    the host, or the accelerator's three boolean splits of the rows by stage; then the
    parts' row counts exchanged and read (DP > 1)."""
    if layout.overlap != "next_step":
        return 0
    return 2 * (layout.dp > 1) + 1 + (1 if layout.optimizer == "cpu" else 3)
