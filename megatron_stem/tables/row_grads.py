"""A step's row gradients of a STEM table, summed in one order wherever the table lives.

A table lookup's backward gives a row-sparse gradient: one value per token position,
indexed by the position's row (`F.embedding(..., sparse=True)`), on the table itself
(`tables.placement: device`) or on a micro-batch's staged rows (`host`,
tables/host_tables.py). Each backward's gradient goes to the table's `RowGradSum`, which
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

When: a device-placed table's step is staged with its rows known on the host (`StepRows`),
and its sum runs at the end of the step's last backward on a side stream, sync-free: under
the tail of DeepSpeed's gradient reduction (whose epilogue the host then waits in), not
after it on the step's critical path. The sums' bits are the same either way (the same
ops on the same rows in the same order).
"""

from __future__ import annotations

from typing import Optional

import torch

HOST_TOKENS = "host_tokens"  # a micro-batch's token ids in host memory (its `tokens`' copy)


def host_tokens(batch: dict) -> torch.Tensor:
    """A micro-batch's token ids in host memory: the loader's copy, else `tokens` read back
    (a sync on a GPU: micro-batches made elsewhere, by tests and benchmarks)."""
    return batch[HOST_TOKENS] if HOST_TOKENS in batch else batch["tokens"].cpu()


class StepRows:
    """The rows a step's micro-batches look up, known on the host before their backwards
    (from the token ids the trainer feeds, `TableOptimizer.stage`): per micro-batch its
    distinct rows (sorted), the step's union, and where each micro-batch's rows sit in the
    union, all on `device`. With them a step's gradients are summed with no host sync:
    `torch.unique` of the gradients' rows on a GPU would read its output size back, once per
    micro-batch and table, stalling the host where it should be queueing DeepSpeed's last
    reduction (`RowGradSum`)."""

    def __init__(self, host_ids: list[torch.Tensor], device: torch.device):
        per_mb = [torch.unique(ids.flatten().to("cpu", torch.long)) for ids in host_ids]
        union = torch.unique(torch.cat(per_mb)) if per_mb else torch.empty(0, dtype=torch.long)

        def to(t):  # small index tensors; a pageable source is staged as the call returns
            return t.to(device, non_blocking=True)
        self.rows = to(union)
        self.microbatch_rows = [to(r) for r in per_mb]
        self.positions = [to(torch.searchsorted(union, r)) for r in per_mb]

    @property
    def microbatches(self) -> int:
        return len(self.microbatch_rows)

    def tensors(self) -> list[torch.Tensor]:
        return [self.rows, *self.microbatch_rows, *self.positions]


class RowGradSum:
    """Collects the row-sparse gradients of one table, one per backward (`add`), and hands
    out their sum (`take`). `width`, `dtype`, `device`: the rows' (for an empty step).

    Given the step's rows ahead (`expect`) and a side stream (`streams`, streams.py), the
    sum is queued when the step's last backward ends (an autograd callback queued by the
    hook of its last gradient), on the side stream: it runs while DeepSpeed's gradient
    reduction finishes on the network, where the compute stream would otherwise wait, and
    `take` finds it done. Without them `take` sums (benchmarks, tests; host tables, whose
    staged rows are summed as each backward gives them)."""

    def __init__(self, width: int, dtype: torch.dtype, device: torch.device):
        self.width, self.dtype, self.device = width, dtype, device
        # Per backward, in order: its sparse gradient, or already its (rows, fp32 sums).
        self._parts: list[torch.Tensor | tuple[torch.Tensor, torch.Tensor]] = []
        self._rows: Optional[StepRows] = None
        self._streams = None
        self._queued = False
        self._result = self._event = None

    def expect(self, rows: Optional[StepRows], streams=None) -> None:
        """The rows of the step about to run (None: not known), and the side stream to sum
        its gradients on at the end of its last backward (None: `take` sums them)."""
        if self._parts:
            raise RuntimeError("RowGradSum.expect: the last step's gradients were not taken")
        self._rows, self._streams = rows, streams

    def add(self, grad: torch.Tensor, row_ids: Optional[torch.Tensor] = None) -> None:
        """One backward's gradient: sparse, indexed by table row, or by position in
        `row_ids` (a micro-batch's staged rows: its sorted unique ids)."""
        if not grad.is_sparse:
            raise RuntimeError(f"a STEM table's gradient is dense, of shape "
                               f"{tuple(grad.shape)}: look it up with a row-sparse gradient "
                               "(StemTable.sparse_grad = True)")
        if self._queued:
            raise RuntimeError("a STEM table's gradient arrived after the backwards of the "
                               "micro-batches staged for the step (TableOptimizer.stage)")
        if row_ids is None:  # which rows: from `expect`, or a unique in `take`
            self._parts.append(grad)
            return
        # Staged rows are all looked up: summed now, keeping [rows, w], not [positions, w].
        sums = _position_sums(grad._indices()[0], grad._values(), row_ids.numel())
        self._parts.append((row_ids.to(grad.device, non_blocking=True), sums))

    def take_grad(self, param: torch.Tensor, row_ids: Optional[torch.Tensor] = None) -> None:
        """Moves `param`'s gradient (a table's, or staged rows `row_ids`'), if any, here."""
        if param.grad is not None:
            self.add(param.grad, row_ids)
            param.grad = None

    def hook(self, param: torch.Tensor, row_ids: Optional[torch.Tensor] = None) -> None:
        """A post-accumulate-grad hook: moves each backward's gradient of `param` (a
        table, or staged rows `row_ids`) here; the step's last queues the sum (in the
        backward: an autograd callback can only be queued there)."""
        self.take_grad(param, row_ids)
        if (self._streams is not None and self._rows is not None and not self._queued
                and len(self._parts) == self._rows.microbatches):
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._start)

    def _start(self) -> None:
        """At the end of the step's last backward: the sum, queued on the side stream after
        the backward's kernels, reading the gradients recorded there."""
        streams = self._streams
        streams.hand_over([t for p in self._parts for t in (p._indices(), p._values())]
                          + self._rows.tensors())
        with streams.running():
            self._result = self._sum()
            # (made on the side stream, read on the compute stream after `wait`: the side
            # stream's next work starts with a `hand_over`, after everything queued here)
            self._event = streams.mark()

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The touched rows (sorted, on the gradients' device) and their summed gradients
        [rows, width] (module docstring); forgets them."""
        rows, total, looked_up = self.take_unchecked()
        check_looked_up([looked_up])
        return rows, total

    def take_unchecked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`take`, and a device bool (no sync): whether the backwards' rows were the
        expected ones (`check_looked_up` reads it)."""
        if self._result is not None:
            self._streams.wait(self._event)
            result = self._result
        else:
            result = self._sum()
        self._parts, self._rows, self._streams = [], None, None
        self._queued, self._result = False, None
        return result

    def _sum(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self._parts:
            return (torch.empty(0, dtype=torch.long, device=self.device),
                    torch.empty(0, self.width, dtype=self.dtype, device=self.device),
                    torch.ones((), dtype=torch.bool, device=self.device))
        known = self._rows
        if known is None:  # rows from the gradients themselves (a `unique` each: syncs)
            parts = [p if isinstance(p, tuple) else _row_sums(p) for p in self._parts]
            rows = torch.unique(torch.cat([ids for ids, _ in parts]))
            positions = [torch.searchsorted(rows, ids) for ids, _ in parts]
            part_sums = [sums for _, sums in parts]
            ok = torch.ones((), dtype=torch.bool, device=rows.device)
        else:
            if known.microbatches != len(self._parts):
                raise RuntimeError(f"a STEM table had {len(self._parts)} backwards in a step "
                                   f"staged with {known.microbatches} micro-batches "
                                   "(TableOptimizer.stage)")
            summed = [_known_row_sums(p, r) for p, r in zip(self._parts, known.microbatch_rows)]
            rows, positions = known.rows, known.positions
            part_sums = [sums for sums, _ in summed]
            ok = torch.stack([looked_up for _, looked_up in summed]).all()
        total = torch.zeros(rows.numel(), self.width, dtype=torch.float32, device=rows.device)
        for at, sums in zip(positions, part_sums):  # each row once per part: no two additions race
            total.index_add_(0, at, sums)
        return rows, total.to(self.dtype), ok


LOOKED_UP_OTHERS = ("STEM tables were looked up with other token ids than the micro-batches "
                    "staged for the step (TableOptimizer.stage): their row gradients would be "
                    "summed into the wrong rows")


def check_looked_up(flags: list[torch.Tensor]) -> None:
    """Refuse a step whose tables were looked up with other ids than the ones staged (a
    host sync: the trainer reads the flag with the step's other values instead)."""
    if not bool(torch.stack(flags).all()):
        raise RuntimeError(LOOKED_UP_OTHERS)


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
    row_grads.take_grad(param)
    return row_grads


def take_same_rows(sums: list[RowGradSum]) -> tuple[torch.Tensor, list[torch.Tensor],
                                                   torch.Tensor]:
    """`take_unchecked` of every table of a step: their rows, which must be the same (every
    table is looked up with the same token ids: one `StepRows` for all, or compared), each
    table's summed gradients, and whether every lookup read the rows expected (a device
    bool, for the caller to read: `check_looked_up`)."""
    known = [s._rows for s in sums]
    taken = [s.take_unchecked() for s in sums]
    rows = taken[0][0]
    same = known[0] is not None and all(k is known[0] for k in known)
    if not same and any(not torch.equal(rows, r) for r, _, _ in taken[1:]):
        raise RuntimeError("STEM tables were looked up with different token ids in one "
                           "step; the table path sends one row set for all")
    return rows, [g for _, g, _ in taken], torch.stack([ok for _, _, ok in taken]).all()


def _row_sums(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted rows, fp32 sums) of one backward's sparse gradient indexed by table row."""
    rows, inverse = torch.unique(grad._indices()[0], return_inverse=True)
    return rows, _position_sums(inverse, grad._values(), rows.numel())


def _known_row_sums(grad: torch.Tensor,
                    rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 sums of one backward's sparse gradient over its rows known ahead (sorted), no
    sync: each position's row found by a search, the same positions as `torch.unique`'s
    inverse gives for the rows present; and a device bool: every position's row is there."""
    index = grad._indices()[0]
    if not rows.numel():
        return (torch.zeros(0, grad.shape[1], dtype=torch.float32, device=index.device),
                torch.full((), index.numel() == 0, device=index.device))
    at = torch.searchsorted(rows, index).clamp_(max=rows.numel() - 1)  # (a stray id: flagged)
    ok = (rows[at] == index).all()
    return _position_sums(at, grad._values(), rows.numel()), ok


def _position_sums(index: torch.Tensor, values: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows, w] fp32: values[i] added to row index[i], for i in position order."""
    return torch.ops.aten.embedding_dense_backward(values.float(), index, rows, -1, False)
