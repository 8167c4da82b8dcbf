"""What the STEM tables' training path moves, per rank per step: one function per counter.

The step planner predicts with these functions (from modelled row counts, `rows.py`) and
the trainer logs the same functions to TensorBoard (`tables/*`, from the row counts it
measured), so a planned number and a logged one cannot drift apart: a test checks that
they equal the bytes the code really moves.

Conventions. Bytes of a collective are this rank's buffer: all-reduce and reduce: the
buffer; all-to-all: what this rank sends (its own share included); all-gather: what it
receives (the gathered output). The planner's link model (`hardware.py`) turns buffers
into wire time. "Rows" are table rows (one token id); each table of a layout has the same
rows, so ids travel once for all tables where the code sends them once.

Layouts (docs/tables.md, "The table update"):
* `replicated` (today's path): `device`: every rank all-reduces the union of touched rows
  in fp32 and runs CPU Adam against its own full master; `host`: one fp32 copy per node
  (the master), rows owned by the copy's ranks, in-node reduce to owners, cross-node
  all-reduce of owned rows.
* `sharded`: each row has one owner over all DP ranks (contiguous ranges of rows/DP);
  grads go to owners in the training dtype (all-to-all), owners update their rows, and the
  updated rows are all-gathered (`device`: bf16 into every rank's table; `host`: fp32 into
  the other nodes' copies).
"""

from __future__ import annotations

from dataclasses import dataclass

ID_BYTES = 8  # int64 row ids
FP32 = 4


@dataclass(frozen=True)
class TableShape:
    """The STEM tables of one tensor-parallel slice."""

    tables: int
    rows: int  # vocabulary
    width: int  # columns of this TP slice (ffn_hidden_size / TP)

    @property
    def elements(self) -> int:
        return self.tables * self.rows * self.width


@dataclass(frozen=True)
class Layout:
    placement: str  # "device" | "host"
    update: str  # "dense" | "lazy"
    partition: str  # "replicated" | "sharded"
    optimizer: str  # "cpu" | "gpu": where master and moments live
    dp: int  # data-parallel ranks training the tables
    ranks_per_copy: int  # host placement: ranks sharing one host copy (a node's)
    grad_bytes: int  # the training dtype's bytes (bf16 2, fp32 4)
    param_bytes: int  # the device table's element bytes
    device_is_host: bool = False  # CPU training: device memory is host memory

    @property
    def copies(self) -> int:
        """Host copies of the tables (nodes)."""
        return max(1, self.dp // self.ranks_per_copy)

    @property
    def own_master(self) -> bool:
        """An fp32 table in CPU memory is its own fp32 master (no separate copy)."""
        return self.device_is_host and self.param_bytes == FP32 and self.placement == "device"

    @property
    def sharers(self) -> int:
        """Ranks that split the optimizer work and state of one table copy."""
        if self.partition == "sharded":
            return self.dp
        return self.ranks_per_copy if self.placement == "host" else 1


@dataclass(frozen=True)
class RowCounts:
    """Distinct rows of one step, as this rank sees them (measured, or modelled)."""

    rank_rows: int  # distinct ids of this rank's micro-batches
    union_rows: int  # distinct ids of all DP ranks (the rows `lazy` updates)
    owned_rows: int  # of the union, the rows in this rank's part (sharers > 1)
    microbatch_rows: int  # distinct ids summed over this rank's micro-batches (staging)
    longest_rank_rows: int = 0  # max rank_rows over DP (the padded id all-gather)


def rows_bytes(rows: float, shape: TableShape, elem_bytes: int) -> float:
    return rows * shape.width * elem_bytes * shape.tables


def owned_range_rows(shape: TableShape, layout: Layout) -> int:
    """Rows in this rank's contiguous range (`dense` updates all of them)."""
    return -(-shape.rows // layout.sharers)


def owned_touched_rows(layout: Layout, counts: RowCounts) -> int:
    """Touched rows this rank updates: all of the union when it updates every row."""
    return counts.union_rows if layout.sharers == 1 else counts.owned_rows


def updated_rows(shape: TableShape, layout: Layout, counts: RowCounts) -> int:
    """Rows this rank's optimizer updates: its whole range (`dense`) or its touched rows."""
    if layout.update == "dense":
        return owned_range_rows(shape, layout)
    return owned_touched_rows(layout, counts)


# -- the counters -------------------------------------------------------------------------


def id_exchange_bytes(shape: TableShape, layout: Layout, counts: RowCounts) -> float:
    """Row ids exchanged over DP. Replicated: a padded all-gather of every rank's ids
    (device placement repeats it per table: each table's union is computed alone);
    sharded: the row counts, then each id sent to its owner."""
    if layout.dp == 1:
        return 0
    if layout.partition == "sharded":
        return layout.dp * ID_BYTES + counts.rank_rows * ID_BYTES
    longest = counts.longest_rank_rows or counts.rank_rows
    per_union = layout.dp * (longest + 1) * ID_BYTES  # + the count all-gather
    return per_union * (shape.tables if layout.placement == "device" else 1)


def grad_allreduce_bytes(shape: TableShape, layout: Layout, counts: RowCounts) -> float:
    """Replicated device: the fp32 all-reduce of the union's rows."""
    if layout.partition != "replicated" or layout.placement != "device" or layout.dp == 1:
        return 0
    return rows_bytes(counts.union_rows, shape, FP32)


def grad_reduce_bytes(shape: TableShape, layout: Layout, counts: RowCounts) -> float:
    """Replicated host: the union's fp32 rows reduced to their owners in the node."""
    if layout.partition != "replicated" or layout.placement != "host" \
            or layout.ranks_per_copy == 1:
        return 0
    return rows_bytes(counts.union_rows, shape, FP32)


def cross_copy_allreduce_bytes(shape: TableShape, layout: Layout, counts: RowCounts) -> float:
    """Replicated host: each owner's rows all-reduced with the same owner on other nodes."""
    if layout.partition != "replicated" or layout.placement != "host" or layout.copies == 1:
        return 0
    return rows_bytes(owned_touched_rows(layout, counts), shape, FP32)


def grads_to_owners_bytes(shape: TableShape, layout: Layout, counts: RowCounts) -> float:
    """Sharded: this rank's touched rows' grads sent to their owners (all-to-all), in the
    training dtype."""
    if layout.partition != "sharded" or layout.dp == 1:
        return 0
    return rows_bytes(counts.rank_rows, shape, layout.grad_bytes)


def allgather_bytes(shape: TableShape, layout: Layout, counts: RowCounts) -> float:
    """Sharded: the updated rows every rank receives. Device placement: every owner's
    updated rows into every table (param dtype); host: the other copies' owners of the
    same range send theirs, fp32, so every node's copy stays the exact master."""
    if layout.partition != "sharded" or layout.dp == 1:
        return 0
    mine = updated_rows(shape, layout, counts)
    if layout.placement == "device":
        rows = shape.rows if layout.update == "dense" else counts.union_rows
        return rows_bytes(rows, shape, layout.param_bytes)
    if layout.copies == 1:
        return 0
    return rows_bytes(mine * layout.copies, shape, FP32)


def comm_bytes(shape: TableShape, layout: Layout, counts: RowCounts) -> float:
    """`tables/comm_bytes`: every table collective's buffer, summed."""
    return sum(f(shape, layout, counts) for f in (
        id_exchange_bytes, grad_allreduce_bytes, grad_reduce_bytes,
        cross_copy_allreduce_bytes, grads_to_owners_bytes, allgather_bytes))


def grad_d2h_bytes(shape: TableShape, layout: Layout, counts: RowCounts) -> float:
    """Row grads copied to the CPU optimizer, fp32: replicated device, the union's (every
    rank updates every row); otherwise the touched rows this rank updates."""
    if layout.device_is_host or layout.optimizer == "gpu":
        return 0
    return rows_bytes(owned_touched_rows(layout, counts), shape, FP32)


def peer_rows_d2h_bytes(shape: TableShape, layout: Layout, counts: RowCounts) -> float:
    """Sharded host: the other copies' updated rows, fp32, written into this node's copy."""
    if layout.partition != "sharded" or layout.placement != "host" or layout.copies == 1 \
            or layout.device_is_host:
        return 0
    return rows_bytes(updated_rows(shape, layout, counts) * (layout.copies - 1), shape, FP32)


def d2h_bytes(shape: TableShape, layout: Layout, counts: RowCounts) -> float:
    """`tables/d2h_bytes`."""
    return grad_d2h_bytes(shape, layout, counts) + peer_rows_d2h_bytes(shape, layout, counts)


def staging_h2d_bytes(shape: TableShape, layout: Layout, counts: RowCounts) -> float:
    """Host placement: every micro-batch's rows staged in the training dtype (counted on
    CPU too, where the "copy" is a clone, as the host store counts it)."""
    if layout.placement != "host":
        return 0
    return rows_bytes(counts.microbatch_rows, shape, layout.grad_bytes)


def writeback_h2d_bytes(shape: TableShape, layout: Layout, counts: RowCounts) -> float:
    """Updated rows sent to the device. Device placement: replicated `dense` copies the
    whole fp32 master (cast on the device), replicated `lazy` the union cast on the CPU,
    sharded the rows this rank updated (cast on the CPU). Sharded host: this rank's
    updated fp32 rows on their way to the other copies."""
    if layout.optimizer == "gpu" or layout.own_master:
        return 0
    if layout.placement == "host":
        if layout.partition == "sharded" and layout.copies > 1 and not layout.device_is_host:
            return rows_bytes(updated_rows(shape, layout, counts), shape, FP32)
        return 0
    if layout.partition == "replicated":
        if layout.update == "dense":
            return rows_bytes(shape.rows, shape, FP32)
        return rows_bytes(counts.union_rows, shape, layout.param_bytes)
    return rows_bytes(updated_rows(shape, layout, counts), shape, layout.param_bytes)


def h2d_bytes(shape: TableShape, layout: Layout, counts: RowCounts) -> float:
    """`tables/h2d_bytes`."""
    return staging_h2d_bytes(shape, layout, counts) + writeback_h2d_bytes(shape, layout, counts)


def cpu_adam_elements(shape: TableShape, layout: Layout, counts: RowCounts) -> float:
    """`tables/cpu_adam_elements`: elements this rank's CPU Adam updates."""
    if layout.optimizer == "gpu":
        return 0
    return rows_bytes(updated_rows(shape, layout, counts), shape, 1)


def gpu_adam_elements(shape: TableShape, layout: Layout, counts: RowCounts) -> float:
    if layout.optimizer != "gpu":
        return 0
    return rows_bytes(updated_rows(shape, layout, counts), shape, 1)


def cpu_state_bytes(shape: TableShape, layout: Layout) -> float:
    """`tables/cpu_state_bytes`: this rank's share of the CPU memory the tables' optimizer
    holds: fp32 master and two moments of the rows it owns (the master is the table itself
    for an fp32 CPU table, and for host placement the node's copy, shared by its ranks)."""
    if layout.optimizer == "gpu":
        return 0
    owned = owned_range_rows(shape, layout)
    if layout.placement == "host":
        copy_share = -(-shape.rows // layout.ranks_per_copy)
        return rows_bytes(copy_share, shape, FP32) + rows_bytes(owned, shape, 2 * FP32)
    per_row = 2 * FP32 if layout.own_master else 3 * FP32
    return rows_bytes(owned, shape, per_row)


def gpu_state_bytes(shape: TableShape, layout: Layout) -> float:
    """Device memory of the tables: the device table (device placement) and, with the GPU
    optimizer, the owned rows' fp32 master and moments."""
    table = rows_bytes(shape.rows, shape, layout.param_bytes) \
        if layout.placement == "device" else 0
    if layout.optimizer == "gpu":
        table += rows_bytes(owned_range_rows(shape, layout), shape, 3 * FP32)
    return table


def counters(shape: TableShape, layout: Layout, counts: RowCounts) -> dict[str, float]:
    """The trainer's `tables/*` TensorBoard counters, per rank per step."""
    return {
        "tables/comm_bytes": comm_bytes(shape, layout, counts),
        "tables/d2h_bytes": d2h_bytes(shape, layout, counts),
        "tables/h2d_bytes": h2d_bytes(shape, layout, counts),
        "tables/cpu_adam_elements": cpu_adam_elements(shape, layout, counts),
        "tables/cpu_state_bytes": cpu_state_bytes(shape, layout),
        "tables/touched_rows": counts.union_rows,
        "tables/rank_rows": counts.rank_rows,
    }
