"""What the STEM tables' training path moves, per rank per step: one function per counter.

The step planner predicts with these functions (from modelled row counts, `rows.py`); the
trainer counts the same quantities as it moves them (`TrafficCounters` in
tables/shards.py, logged as `tables/*`): each function below names the counter it
predicts and follows the code's path, so a test can hold the two equal on measured row
counts.

Conventions (the trainer's): bytes a rank sends to, or receives from, OTHER ranks; a rank's
own share of a collective is not counted (an all-reduce's buffer is: every byte of it
travels). "Rows" are table rows (token ids); every table of a layout has the same rows.

Layouts (docs/tables.md):
* `replicated`: `device`: every rank all-reduces the union of touched rows in fp32 (per
  table, after one padded all-gather of ids) and runs CPU Adam against its own full master;
  `host`: one fp32 copy per node (the master), rows owned by the copy's ranks, in-node
  reduce to owners, cross-node all-reduce of owned rows.
* `sharded`: each DP rank owns rows/DP rows (an interleaved sample of the vocabulary);
  one all-to-all of counts and ids,
  one of all tables' grads (training dtype); owners sum in fp32 and update; updated rows
  are all-gathered (`device`: into every rank's table, param dtype; `host`: into the other
  nodes' copies, fp32). `dense` gathers whole shards; `lazy` (and `next_step`'s two
  phases) gather padded row sets with their ids.
"""

from __future__ import annotations

from dataclasses import dataclass

ID_BYTES = 8  # int64 row ids and counts
FP32 = 4


@dataclass(frozen=True)
class TableShape:
    """The STEM tables of one tensor-parallel slice."""

    tables: int
    rows: int  # vocabulary
    width: int  # columns of this TP slice (ffn_hidden_size / TP)


@dataclass(frozen=True)
class Layout:
    placement: str  # "device" | "host"
    update: str  # "dense" | "lazy"
    partition: str  # "replicated" | "sharded"
    optimizer: str  # "cpu" | "accelerator": where master and moments live
    dp: int  # data-parallel ranks training the tables
    ranks_per_copy: int  # host placement: ranks sharing one host copy (a node's)
    grad_bytes: int  # the training dtype's bytes (bf16 2, fp32 4)
    param_bytes: int  # the device table's element bytes
    device_is_host: bool = False  # CPU training: device memory is host memory
    overlap: str = "none"  # "next_step": the update gathers rows in two phases

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

    @property
    def holders(self) -> int:
        """Sharded: the ranks an owner's updated rows go to, itself included (every DP
        rank's device table, or one rank per host copy)."""
        return self.dp if self.placement == "device" else self.copies


@dataclass(frozen=True)
class RowCounts:
    """Distinct rows of one step as this rank sees them (measured, or modelled)."""

    rank_rows: int  # distinct ids of this rank's micro-batches
    union_rows: int  # distinct ids of all DP ranks (the rows `lazy` updates)
    owned_rows: int  # of the union, the rows in this rank's part (sharers > 1)
    microbatch_rows: int  # distinct ids summed over this rank's micro-batches (staging)
    longest_rank_rows: int = 0  # max rank_rows over DP (replicated: the padded ids)
    self_rows: int = 0  # sharded: of rank_rows, those this rank owns (not sent)
    longest_owned_rows: int = 0  # max owned_rows over the holders (padded gathers)
    # distinct ids of every DP rank's first micro-batch (`next_step` updates them first;
    # 0: as union_rows)
    first_microbatch_union_rows: int = 0

    def longest_rank(self) -> int:
        return self.longest_rank_rows or self.rank_rows

    def longest_owned(self) -> int:
        return self.longest_owned_rows or self.owned_rows


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


def padded_gathers(layout: Layout) -> bool:
    """Sharded updates published as padded row sets (ids + rows), not whole shards."""
    return layout.update == "lazy" or layout.overlap == "next_step"


# -- index_bytes ---------------------------------------------------------------------------


def index_bytes(shape: TableShape, layout: Layout, counts: RowCounts) -> float:
    """`index_bytes`: row ids and counts. Replicated: the padded ids all-gathered once.
    Sharded: the counts (sent and received) and the ids to
    their owners; `next_step` again for the next step's rows; padded gathers add every
    holder's ids; host `lazy` the changed rows for the row cache."""
    if layout.dp == 1:
        return 0
    if layout.partition == "replicated":
        return layout.dp * counts.longest_rank() * ID_BYTES
    sent = counts.rank_rows - (counts.self_rows or counts.rank_rows / layout.dp)
    to_owners = 2 * layout.dp * ID_BYTES + sent * ID_BYTES
    out = to_owners * (2 if layout.overlap == "next_step" else 1)
    if padded_gathers(layout) and layout.holders > 1:
        phases = 2 if layout.overlap == "next_step" else 1
        out += phases * shape.tables * layout.holders * (ID_BYTES + counts.longest_owned()
                                                          * ID_BYTES)
    if layout.placement == "host" and layout.update == "lazy":
        out += layout.dp * (ID_BYTES + counts.longest_owned() * ID_BYTES)
    return out


# -- grad_bytes ----------------------------------------------------------------------------


def grad_allreduce_bytes(shape: TableShape, layout: Layout, counts: RowCounts) -> float:
    """Replicated device: the fp32 all-reduce of the union's rows, per table."""
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
    """Sharded: this rank's touched rows' grads sent to their (other) owners, all tables
    in one all-to-all, in the training dtype."""
    if layout.partition != "sharded" or layout.dp == 1:
        return 0
    sent = counts.rank_rows - (counts.self_rows or counts.rank_rows / layout.dp)
    return rows_bytes(sent, shape, layout.grad_bytes)


def grad_bytes(shape: TableShape, layout: Layout, counts: RowCounts) -> float:
    """`grad_bytes`."""
    return sum(f(shape, layout, counts) for f in (
        grad_allreduce_bytes, grad_reduce_bytes, cross_copy_allreduce_bytes,
        grads_to_owners_bytes))


# -- gather_bytes --------------------------------------------------------------------------


def gather_bytes(shape: TableShape, layout: Layout, counts: RowCounts) -> float:
    """`gather_bytes`, sharded: updated rows received from the other holders (device
    placement in the table's dtype, host copies in fp32). `dense`: whole shards; padded
    gathers (`lazy`, `next_step`): every holder's longest row set."""
    if layout.partition != "sharded" or layout.holders == 1:
        return 0
    elem = layout.param_bytes if layout.placement == "device" else FP32
    if not padded_gathers(layout):
        return rows_bytes(owned_range_rows(shape, layout) * (layout.holders - 1), shape, elem)
    if layout.update == "dense":  # next_step: the whole shard in two padded phases
        rows = owned_range_rows(shape, layout)
    else:
        rows = counts.longest_owned()
    return rows_bytes(rows * (layout.holders - 1), shape, elem)


def comm_bytes(shape: TableShape, layout: Layout, counts: RowCounts) -> float:
    """`comm_bytes` = grad + gather + index bytes."""
    return grad_bytes(shape, layout, counts) + gather_bytes(shape, layout, counts) + \
        index_bytes(shape, layout, counts)


# -- copies between host and device --------------------------------------------------------


def grad_d2h_bytes(shape: TableShape, layout: Layout, counts: RowCounts) -> float:
    """`grad_d2h_bytes`: row grads (fp32) leaving the device for the CPU optimizer:
    replicated device the union's, otherwise the touched rows this rank updates."""
    if layout.device_is_host or layout.optimizer != "cpu":
        return 0
    return rows_bytes(owned_touched_rows(layout, counts), shape, FP32)


def update_h2d_bytes(shape: TableShape, layout: Layout, counts: RowCounts) -> float:
    """`update_h2d_bytes`: updated rows sent to the device table, cast on the CPU first (sharded
    device placement: the rows this rank updated; replicated: `dense` the whole fp32
    master, cast on the device, `lazy` the union, cast on the CPU). Sharded host copies:
    the owner's fp32 rows, to the accelerator for the all-gather to the other copies."""
    if layout.optimizer != "cpu" or layout.device_is_host:
        return 0
    if layout.placement == "host":
        if layout.partition != "sharded" or layout.copies == 1:
            return 0
        return rows_bytes(updated_rows(shape, layout, counts), shape, FP32)
    if layout.partition == "replicated":
        if layout.update == "dense":
            return rows_bytes(shape.rows, shape, FP32)
        return rows_bytes(counts.union_rows, shape, layout.param_bytes)
    return rows_bytes(updated_rows(shape, layout, counts), shape, layout.param_bytes)


def publish_d2h_bytes(shape: TableShape, layout: Layout, counts: RowCounts) -> float:
    """`publish_d2h_bytes`: sharded host copies, the other copies' gathered rows back from
    the accelerator into this node's copy (what `gather_bytes` received)."""
    if layout.placement != "host" or layout.device_is_host:
        return 0
    return gather_bytes(shape, layout, counts)


def staging_h2d_bytes(shape: TableShape, layout: Layout, counts: RowCounts) -> float:
    """Host placement: every micro-batch's rows staged in the training dtype (the host
    store's `h2d_bytes`; on a CPU its "copy" is a clone)."""
    if layout.placement != "host":
        return 0
    return rows_bytes(counts.microbatch_rows, shape, layout.grad_bytes)


# -- the optimizer -------------------------------------------------------------------------


def adam_elements(shape: TableShape, layout: Layout, counts: RowCounts) -> float:
    """`adam_elements`: elements this rank's table Adam updates (on the CPU or the
    accelerator, as `optimizer` says)."""
    return rows_bytes(updated_rows(shape, layout, counts), shape, 1)


def cpu_state_bytes(shape: TableShape, layout: Layout) -> float:
    """`cpu_state_bytes`: this rank's share of the CPU memory of the tables' optimizer:
    fp32 master and two moments of the rows it owns (the master is the table itself for
    an fp32 CPU table; host placement: the node's copy, shared by its ranks)."""
    if layout.optimizer != "cpu":
        return 0
    owned = owned_range_rows(shape, layout)
    if layout.placement == "host":
        copy_share = -(-shape.rows // layout.ranks_per_copy)
        return rows_bytes(copy_share, shape, FP32) + rows_bytes(owned, shape, 2 * FP32)
    per_row = 2 * FP32 if layout.own_master else 3 * FP32
    return rows_bytes(owned, shape, per_row)


def device_state_bytes(shape: TableShape, layout: Layout) -> float:
    """Device memory of the tables: the device table (device placement) and, with the
    optimizer on the accelerator, the owned rows' fp32 master and moments."""
    table = rows_bytes(shape.rows, shape, layout.param_bytes) \
        if layout.placement == "device" else 0
    if layout.optimizer != "cpu":
        table += rows_bytes(owned_range_rows(shape, layout), shape, 3 * FP32)
    return table


def counters(shape: TableShape, layout: Layout, counts: RowCounts) -> dict[str, float]:
    """The trainer's `tables/*` scalars, per rank per step."""
    return {
        "tables/grad_bytes": grad_bytes(shape, layout, counts),
        "tables/gather_bytes": gather_bytes(shape, layout, counts),
        "tables/index_bytes": index_bytes(shape, layout, counts),
        "tables/comm_bytes": comm_bytes(shape, layout, counts),
        "tables/grad_d2h_bytes": grad_d2h_bytes(shape, layout, counts),
        "tables/update_h2d_bytes": update_h2d_bytes(shape, layout, counts),
        "tables/publish_d2h_bytes": publish_d2h_bytes(shape, layout, counts),
        "tables/h2d_bytes": staging_h2d_bytes(shape, layout, counts),
        "tables/adam_elements": adam_elements(shape, layout, counts),
        "tables/cpu_state_bytes": cpu_state_bytes(shape, layout),
        "tables/unique_rows": counts.union_rows,
        "tables/rank_rows": counts.rank_rows,
    }
