"""AdamW on the tables' rows, in place: DeepSpeed's CPU Adam arithmetic, or torch's.

`AdamKernel.update_rows` is what the tables' optimizer calls; `update` is the flat
reference it is tested against (tests/tables/test_adam_kernel.py)."""

from __future__ import annotations

import itertools
import math

import torch

_kernel_ids = itertools.count(10_000)  # DeepSpeed keys CPU Adam instances by integer id


class AdamKernel:
    """In-place AdamW on contiguous fp32 CPU tensors: DeepSpeed's `cpu_adam` op, or the
    same arithmetic in torch where the op cannot be built (no compiler).

    An element's new value must not depend on what else the call updates (a resumed run,
    another placement or data-parallel layout slices the same rows differently). Two
    things of the op do, and `update` works around both:
    * it keeps beta1^t and beta2^t as running float32 products, multiplied once per call,
      and recomputes them with `pow` (other bits at most steps) when a call's step is not
      the previous call's plus one: after a resume, after a step in which this rank had
      no rows to update, and on every call but the first of a step (one per table, chunk
      or overlap phase). So each update is preceded by a call at step 0 on empty tensors:
      the op then takes `pow` at every step (exactly beta at step 1), the same bits
      whatever was called before; nothing is needed at load time.
    * it updates whole SIMD vectors, then the last `numel % SIMD width` elements in scalar
      code that rounds differently (exp_avg and exp_avg_sq differ by an ulp): those are
      updated in a zero-padded vector instead, so every element goes through vector code.
    """

    VECTOR = 64  # elements: a multiple of every SIMD width the op is built for

    def __init__(self, kind: str, betas: tuple[float, float], eps: float):
        self.betas, self.eps = betas, eps
        self.kind = kind
        self.row_op = self._op = None
        if kind == "deepspeed":
            from megatron_stem.runtime.jit_ops import load_row_adam

            self.row_op = load_row_adam()

    @property
    def op(self):
        """DeepSpeed's flat CPU Adam op, loaded (built) on first use: the tables' updates
        go through `update_rows`; `update` is the flat reference it is tested against."""
        if self._op is None and self.kind == "deepspeed":
            from megatron_stem.runtime.jit_ops import load_cpu_adam

            self._op, self.id = load_cpu_adam(), next(_kernel_ids)
            self._op.create_adam(self.id, 0.0, *self.betas, self.eps, 0.0, True, False)
        return self._op

    def update(self, step: int, lr: float, weight_decay: float, param: torch.Tensor,
               grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        if self.op is not None:
            flat = [t.view(-1) for t in (param, grad, exp_avg, exp_avg_sq)]
            body = param.numel() - param.numel() % self.VECTOR
            self._op_update(step, lr, weight_decay, [t[:body] for t in flat])
            if body < param.numel():
                self._padded_update(step, lr, weight_decay, [t[body:] for t in flat])
            return
        b1, b2 = self.betas
        param.mul_(1 - lr * weight_decay)
        exp_avg.lerp_(grad, 1 - b1)
        exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1 - b2)
        denom = (exp_avg_sq.sqrt() / math.sqrt(1 - b2 ** step)).add_(self.eps)
        param.addcdiv_(exp_avg, denom, value=-lr / (1 - b1 ** step))

    def update_rows(self, step: int, lr: float, weight_decay: float, param: torch.Tensor,
                    exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grads: torch.Tensor,
                    param_rows: torch.Tensor, state_rows: torch.Tensor,
                    grad_rows: torch.Tensor, out: torch.Tensor | None = None,
                    grad_scale: float = 1.0) -> None:
        """AdamW on rows `param_rows` of `param` with rows `state_rows` of the moments and
        gradients `grads[grad_rows] x grad_scale` (a row < 0: a zero gradient; the scale is
        the clipping coefficient), in place; the new rows also into `out` (any float dtype:
        the table's) when given. Per element the arithmetic of `update` on `grad x scale`.

        DeepSpeed: its arithmetic in a row-indexed op (runtime/csrc/row_adam.cpp) that updates the
        rows where they are, scaling each gradient row as it reads it, without the GIL.
        Torch: the rows gathered into contiguous buffers, updated and scattered back, which
        moves the master and moments twice more than Adam does."""
        if self.row_op is not None:
            self.row_op.adam_update_rows(
                step, lr, *self.betas, self.eps, weight_decay, grad_scale, param, exp_avg,
                exp_avg_sq, grads, param_rows, state_rows, grad_rows,
                out if out is not None else torch.empty(0))
            return
        p, m, v = (x.index_select(0, r) for x, r in
                   ((param, param_rows), (exp_avg, state_rows), (exp_avg_sq, state_rows)))
        g = torch.zeros_like(p)  # rows without a gradient (-1) stay zero
        hit = grad_rows >= 0
        g[hit] = grads[grad_rows[hit]]
        if grad_scale != 1.0:
            g.mul_(grad_scale)
        if p.numel():
            self.update(step, lr, weight_decay, p, g, m, v)
        for dst, rows, src in ((param, param_rows, p), (exp_avg, state_rows, m),
                               (exp_avg_sq, state_rows, v)):
            dst.index_copy_(0, rows, src)
        if out is not None:
            out.copy_(p)

    def _op_update(self, step, lr, weight_decay, tensors: list[torch.Tensor]) -> None:
        """tensors: param, grad, exp_avg, exp_avg_sq (after a step-0 call: see the class)"""
        b1, b2 = self.betas
        replay_deepspeed_steps(self.op, self.id, -1, 0, self.betas, self.eps)
        self.op.adam_update(self.id, step, lr, b1, b2, self.eps, weight_decay, True, *tensors)

    def _padded_update(self, step, lr, weight_decay, tail: list[torch.Tensor]) -> None:
        """Update `tail` (fewer than VECTOR elements each) through the op's vector code."""
        padded = torch.zeros(len(tail), self.VECTOR)  # zeros stay zeros (and finite)
        padded[:, :tail[0].numel()] = torch.stack(tail)
        self._op_update(step, lr, weight_decay, list(padded.unbind(0)))
        for i in (0, 2, 3):  # the grad is only read
            tail[i].copy_(padded[i, :tail[i].numel()])


def replay_deepspeed_steps(op, opt_id: int, seen: int, upto: int,
                           betas: tuple[float, float], eps: float) -> None:
    """Advance DeepSpeed CPU Adam instance `opt_id` (op `op`), last called at step `seen`,
    through steps seen+1..upto without touching any tensor, so that its running beta
    powers are those of an instance that ran every step (see `AdamKernel`). For
    DeepSpeed's own `DeepSpeedCPUAdam` too, which restarts at step 0 after a load."""
    empty = torch.empty(0)
    for step in range(seen + 1, upto + 1):
        op.adam_update(opt_id, step, 0.0, betas[0], betas[1], eps, 0.0, True,
                       empty, empty, empty, empty)
