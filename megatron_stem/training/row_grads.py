"""A step's row gradients of a STEM table, summed in one order wherever the table lives.

A table lookup's backward gives a row-sparse gradient: one value per token position,
indexed by the position's row (`F.embedding(..., sparse=True)`), on the table itself
(`tables.placement: device`) or on a micro-batch's staged rows (`host`,
training/host_tables.py). Each backward's gradient goes to the table's `RowGradSum`, which
sums a row's gradients the one way both placements share:

1. per backward (one micro-batch), in fp32, by `aten.embedding_dense_backward` (the
   embedding backward itself: in token-position order on a CPU; on a GPU in its own
   sort-based order, the same op for both placements);
2. then the backwards' sums in the order they ran, in fp32;
3. rounded once to the gradients' dtype (the training dtype: what the rows' owners
   receive, `tables/shards.py` `to_owners`).

So the same tokens give the same bits in either placement, and the sums no longer depend
on `coalesce()` (whose order of additions, an unstable sort's, differs from position
order) nor, in bf16 training, on bf16 running sums.
"""

from __future__ import annotations

from typing import Optional

import torch


class RowGradSum:
    """Collects the row-sparse gradients of one table, one per backward (`add`), and hands
    out their sum (`take`). `width`, `dtype`, `device`: the rows' (for an empty step)."""

    def __init__(self, width: int, dtype: torch.dtype, device: torch.device):
        self.width, self.dtype, self.device = width, dtype, device
        # Per backward, in order: its sparse gradient, or already its (rows, fp32 sums).
        self._parts: list[torch.Tensor | tuple[torch.Tensor, torch.Tensor]] = []

    def add(self, grad: torch.Tensor, row_ids: Optional[torch.Tensor] = None) -> None:
        """One backward's gradient: sparse, indexed by table row, or by position in
        `row_ids` (a micro-batch's staged rows: its sorted unique ids)."""
        if not grad.is_sparse:
            raise RuntimeError(f"a STEM table's gradient is dense, of shape "
                               f"{tuple(grad.shape)}: look it up with a row-sparse gradient "
                               "(StemTable.sparse_grad = True)")
        if row_ids is None:  # which rows: a unique, which syncs a GPU; left to `take`
            self._parts.append(grad)
            return
        # Staged rows are all looked up: summed now, keeping [rows, w], not [positions, w].
        sums = _position_sums(grad._indices()[0], grad._values(), row_ids.numel())
        self._parts.append((row_ids.to(grad.device, non_blocking=True), sums))

    def hook(self, param: torch.Tensor, row_ids: Optional[torch.Tensor] = None) -> None:
        """A post-accumulate-grad hook: moves each backward's gradient of `param` (a
        table, or staged rows `row_ids`) here."""
        if param.grad is not None:
            self.add(param.grad, row_ids)
            param.grad = None

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The touched rows (sorted, on the gradients' device) and their summed gradients
        [rows, width] (module docstring); forgets them."""
        parts = [p if isinstance(p, tuple) else _row_sums(p) for p in self._parts]
        self._parts = []
        if not parts:
            return (torch.empty(0, dtype=torch.long, device=self.device),
                    torch.empty(0, self.width, dtype=self.dtype, device=self.device))
        rows = torch.unique(torch.cat([ids for ids, _ in parts]))
        total = torch.zeros(rows.numel(), self.width, dtype=torch.float32, device=rows.device)
        for ids, sums in parts:  # each row once per part: no two additions race on a GPU
            total.index_add_(0, torch.searchsorted(rows, ids), sums)
        return rows, total.to(self.dtype)


def row_grads_of(param: torch.nn.Parameter) -> RowGradSum:
    """The `RowGradSum` of a table parameter (`param.row_grads`), made on first use with a
    hook that moves each backward's gradient into it; one per parameter, whoever asks."""
    acc = getattr(param, "row_grads", None)
    if acc is None:
        acc = param.row_grads = RowGradSum(param.shape[1], param.dtype, param.device)
        param.register_post_accumulate_grad_hook(acc.hook)
    return acc


def table_row_grads(param: torch.nn.Parameter) -> RowGradSum:
    """A device-placed table's row gradients of the step, with a sparse gradient set on
    the parameter directly (not by a backward: benchmarks) counted as one more backward."""
    row_grads = row_grads_of(param)
    row_grads.hook(param)
    return row_grads


def take_same_rows(sums: list[RowGradSum]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`take` of every table of a step: their rows, which must be the same (every table is
    looked up with the same token ids), and each table's summed gradients."""
    taken = [s.take() for s in sums]
    rows = taken[0][0]
    if any(not torch.equal(rows, r) for r, _ in taken[1:]):
        raise RuntimeError("STEM tables were looked up with different token ids in one "
                           "step; the table path sends one row set for all")
    return rows, [g for _, g in taken]


def _row_sums(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted rows, fp32 sums) of one backward's sparse gradient indexed by table row."""
    rows, inverse = torch.unique(grad._indices()[0], return_inverse=True)
    return rows, _position_sums(inverse, grad._values(), rows.numel())


def _position_sums(index: torch.Tensor, values: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows, w] fp32: values[i] added to row index[i], for i in position order."""
    return torch.ops.aten.embedding_dense_backward(values.float(), index, rows, -1, False)
