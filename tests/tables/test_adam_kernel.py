"""DeepSpeed's CPU Adam kernel gives an element the same bits whatever happened before
the step and whatever else the call updates (tables/adam.py, `AdamKernel`).

The op keeps beta1^t and beta2^t as running float32 products and falls back to `pow`
(other bits) when a step is not the previous one plus one: a kernel created at resume, or
one that had no rows to update at some step, drifted by an ulp from an uninterrupted run.
And it updates the elements past the last whole SIMD vector in scalar code that rounds
the moments differently, so the same rows sliced differently (another placement or data
parallel layout) drifted too.
"""

import torch

from megatron_stem.tables.adam import AdamKernel

STEPS = 12


def _kernel() -> AdamKernel:
    return AdamKernel("deepspeed", (0.9, 0.95), 1e-8)


def _grads(seed: int, n: int = 512) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for _ in range(STEPS)]


def _state(n: int = 512) -> list[torch.Tensor]:
    """param, exp_avg, exp_avg_sq"""
    return [torch.randn(n, generator=torch.Generator().manual_seed(1)), torch.zeros(n),
            torch.zeros(n)]


def _update(kernel: AdamKernel, step: int, state: list[torch.Tensor], grad) -> None:
    param, exp_avg, exp_avg_sq = state
    kernel.update(step, 1e-3, 0.1, param, grad, exp_avg, exp_avg_sq)


def test_a_kernel_created_at_resume_continues_bit_exactly():
    grads, straight, resumed = _grads(2), _state(), _state()
    one, before, after = _kernel(), _kernel(), _kernel()  # `after`: created at resume
    for step in range(1, STEPS + 1):
        _update(one, step, straight, grads[step - 1])
        _update(before if step <= STEPS // 2 else after, step, resumed, grads[step - 1])
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))


def test_a_step_without_rows_does_not_change_later_steps():
    """A kernel with other work at every step, and one with nothing to do at step 5 (a
    rank that owns none of the step's rows), give a tensor the same bits."""
    grads, other_grads = _grads(3), _grads(4)
    busy, idle = _kernel(), _kernel()
    by_busy, by_idle, other = _state(), _state(), _state()
    for step in range(1, STEPS + 1):
        _update(busy, step, other, other_grads[step - 1])
        if step != 5:
            _update(busy, step, by_busy, grads[step - 1])
            _update(idle, step, by_idle, grads[step - 1])
    assert all(torch.equal(a, b) for a, b in zip(by_busy, by_idle))


def test_an_element_gets_the_same_bits_however_the_tensor_is_sliced():
    n = 1000
    grads = _grads(5, n)
    whole, kernel = _state(n), _kernel()
    for step in range(1, STEPS + 1):
        _update(kernel, step, whole, grads[step - 1])
    for cut in (1, 7, 100, 999):  # a different part of the tensor in the op's scalar tail
        sliced, kernel = _state(n), _kernel()
        for step in range(1, STEPS + 1):
            for part in (slice(0, cut), slice(cut, n)):
                _update(kernel, step, [t[part] for t in sliced], grads[step - 1][part])
        assert all(torch.equal(a, b) for a, b in zip(whole, sliced)), cut


def test_the_row_op_gives_the_flat_ops_bits_in_place():
    """The row-indexed op (csrc/row_adam.cpp) updates chosen rows where they are, with
    the bits DeepSpeed's flat op gives the same rows packed, also past the last SIMD vector
    (widths that are not a multiple of it), in spans of rows or one by one; zero-gradient
    rows (-1) and untouched rows."""
    kernel = _kernel()
    g = torch.Generator().manual_seed(6)
    for width in (40, 200, 256):
        table = torch.randn(30, width, generator=g)
        moments = [torch.rand(30, width, generator=g) * 1e-2 for _ in range(2)]
        grads = torch.randn(4, width, generator=g)
        # Runs of consecutive rows (5-7 with gradients 1-2 then none, 17-18, 20-21 with
        # none) go to the kernel as one span; the others one row at a time.
        rows = torch.tensor([2, 5, 6, 7, 17, 18, 20, 21, 29, 11])
        grad_rows = torch.tensor([0, 1, 2, -1, 2, 3, -1, -1, 3, 2])
        for step in (1, 2, 9):
            packed = [t.index_select(0, rows) for t in (table, *moments)]
            flat_grads = torch.where(grad_rows[:, None] < 0, 0.0, grads[grad_rows.clamp(min=0)])
            kernel.update(step, 1e-3, 0.1, packed[0], flat_grads, *packed[1:])
            before = [t.clone() for t in (table, *moments)]
            out = torch.empty(rows.numel(), width, dtype=torch.bfloat16)
            kernel.update_rows(step, 1e-3, 0.1, table, *moments, grads, rows, rows, grad_rows,
                               out)
            untouched = torch.ones(30, dtype=torch.bool)
            untouched[rows] = False
            for now, was, expected in zip((table, *moments), before, packed):
                assert torch.equal(now[rows], expected), (width, step)
                assert torch.equal(now[untouched], was[untouched])
            assert torch.equal(out, packed[0].bfloat16())


def test_rows_without_any_gradient_take_a_zero_gradient_in_both_kernels():
    """A `dense` owner none of whose rows any rank touched: no gradient rows at all, every
    row -1. Each kernel gives the rows what a zero gradient gives them in the flat update."""
    g = torch.Generator().manual_seed(7)
    for kernel in (_kernel(), AdamKernel("torch", (0.9, 0.95), 1e-8)):
        table = torch.randn(6, 64, generator=g)
        moments = [torch.rand(6, 64, generator=g) * 1e-2 for _ in range(2)]
        expected = [t.clone() for t in (table, *moments)]
        kernel.update(3, 1e-3, 0.1, expected[0], torch.zeros(6, 64), *expected[1:])
        rows = torch.arange(6)
        kernel.update_rows(3, 1e-3, 0.1, table, *moments, torch.empty(0, 64), rows, rows,
                           torch.full((6,), -1))
        for now, want in zip((table, *moments), expected):
            assert torch.equal(now, want)


def test_the_clipping_scale_is_the_gradients_times_it_in_both_kernels():
    """Clipping folded into the row update: the bits of the same update on gradients
    multiplied by the coefficient beforehand (as a separate pass would)."""
    g = torch.Generator().manual_seed(8)
    for kernel in (_kernel(), AdamKernel("torch", (0.9, 0.95), 1e-8)):
        table = torch.randn(12, 200, generator=g)
        moments = [torch.rand(12, 200, generator=g) * 1e-2 for _ in range(2)]
        grads = torch.randn(5, 200, generator=g)
        rows, grad_rows = torch.tensor([1, 2, 3, 7, 9]), torch.tensor([0, 1, -1, 3, 4])
        folded = [t.clone() for t in (table, *moments)]
        kernel.update_rows(4, 1e-3, 0.1, folded[0], *folded[1:], grads, rows, rows, grad_rows,
                           grad_scale=0.37)
        kernel.update_rows(4, 1e-3, 0.1, table, *moments, grads * 0.37, rows, rows, grad_rows)
        for a, b in zip(folded, (table, *moments)):
            assert torch.equal(a, b), kernel.kind


def test_the_row_op_lets_python_run_meanwhile():
    """The op releases the GIL: while it updates a large table on a worker thread (the
    overlapped update), the main thread's Python keeps running (it launches the next
    step's kernels). With the GIL held, the main thread could not advance at all."""
    import threading

    kernel = _kernel()
    table = torch.randn(60_000, 512)
    moments = [torch.zeros_like(table) for _ in range(2)]
    grads = torch.randn(60_000, 512)
    rows = torch.randperm(60_000)  # scattered rows: one kernel call per row
    counter = {"n": 0, "during": 0}

    def update():
        start = counter["n"]
        kernel.update_rows(1, 1e-3, 0.1, table, *moments, grads, rows, rows, rows)
        counter["during"] = counter["n"] - start

    worker = threading.Thread(target=update)
    worker.start()
    while worker.is_alive():
        counter["n"] += 1
    worker.join()
    assert counter["during"] > 10_000, counter
