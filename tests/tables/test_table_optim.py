"""Table updates against torch's AdamW (dense) and a row-wise Adam (lazy) reference."""

import pytest
import torch
import torch.nn.functional as F

from megatron_stem.tables import optimizer as table_optim
from megatron_stem.config.table_layout import TableLayout
from megatron_stem.tables.optimizer import TableOptimizer

VOCAB, WIDTH, LR, WD, BETAS = 50, 8, 1e-2, 0.1, (0.9, 0.95)


def _batches(steps=6):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB // 2, (2, 7), generator=g) for _ in range(steps)]


def _loss(table, ids):
    return (F.embedding(ids, table, sparse=table.is_leaf and table.requires_grad)
            .sin().sum())


def _run_ours(update, kernel):
    table = torch.nn.Parameter(torch.randn(VOCAB, WIDTH, generator=torch.Generator()
                                           .manual_seed(1)))
    opt = TableOptimizer([("t", table)], TableLayout(update=update, kernel=kernel),
                         lr_mult=1.0, weight_decay=WD, betas=BETAS)
    for ids in _batches():
        _loss(table, ids).backward()
        opt.sync_grads()
        opt.step(LR)
    return table.detach()


def _reference_dense():
    table = torch.nn.Parameter(torch.randn(VOCAB, WIDTH, generator=torch.Generator()
                                           .manual_seed(1)))
    opt = torch.optim.AdamW([table], lr=LR, betas=BETAS, eps=1e-8, weight_decay=WD)
    for ids in _batches():
        opt.zero_grad()
        F.embedding(ids, table).sin().sum().backward()
        opt.step()
    return table.detach()


def _reference_lazy():
    """Row-wise Adam written out: only touched rows move; bias correction by global step."""
    p = torch.randn(VOCAB, WIDTH, generator=torch.Generator().manual_seed(1))
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for step, ids in enumerate(_batches(), start=1):
        leaf = p.clone().requires_grad_()
        F.embedding(ids, leaf).sin().sum().backward()
        rows = ids.unique()
        g = leaf.grad[rows]
        m[rows] = BETAS[0] * m[rows] + (1 - BETAS[0]) * g
        v[rows] = BETAS[1] * v[rows] + (1 - BETAS[1]) * g * g
        m_hat = m[rows] / (1 - BETAS[0] ** step)
        v_hat = v[rows] / (1 - BETAS[1] ** step)
        p[rows] = p[rows] * (1 - LR * WD) - LR * m_hat / (v_hat.sqrt() + 1e-8)
    return p


@pytest.mark.parametrize("kernel", ["torch", "deepspeed"])
def test_dense_update_equals_adamw(kernel, monkeypatch):
    whole = _run_ours("dense", kernel)  # the table is one chunk
    torch.testing.assert_close(whole, _reference_dense(), atol=1e-6, rtol=1e-5)
    # Chunks of 4 rows (the last one 2; touched rows in some, none in others) give the same
    # bits: the zero-gradient buffer is a chunk, not the table. (Multiples of 16 floats:
    # DeepSpeed's SIMD path covers whole chunks, as it does at real widths; its scalar tail
    # would round differently.)
    monkeypatch.setattr(table_optim, "DENSE_CHUNK_BYTES", 4 * WIDTH * 4)
    assert torch.equal(_run_ours("dense", kernel), whole)


@pytest.mark.parametrize("kernel", ["torch", "deepspeed"])
def test_lazy_update_equals_rowwise_adam(kernel):
    ours = _run_ours("lazy", kernel)
    torch.testing.assert_close(ours, _reference_lazy(), atol=1e-6, rtol=1e-5)
    initial = torch.randn(VOCAB, WIDTH, generator=torch.Generator().manual_seed(1))
    assert torch.equal(ours[VOCAB // 2:], initial[VOCAB // 2:])  # never-seen rows untouched


def test_dense_and_lazy_differ_on_untouched_rows():
    dense, lazy = _run_ours("dense", "torch"), _run_ours("lazy", "torch")
    assert not torch.allclose(dense[VOCAB // 2:], lazy[VOCAB // 2:])  # weight decay moved them


@pytest.mark.parametrize("kernel", ["torch", "deepspeed"])
def test_clipping_scales_the_tables_gradients_as_a_hand_clipped_adamw(kernel):
    """Clipping multiplies the gradients before Adam: at step 1 Adam is scale-invariant
    (up to eps), so the steps after it tell. Against torch's AdamW on gradients multiplied
    by the same coefficients by hand; and not the unclipped curve."""
    coefs = [0.5, 0.25, 1.0, 0.1]

    def ours(clip):
        table = torch.nn.Parameter(torch.randn(VOCAB, WIDTH, generator=torch.Generator()
                                               .manual_seed(1)))
        opt = TableOptimizer([("t", table)], TableLayout(update="dense", kernel=kernel),
                             1.0, WD, BETAS)
        for ids, c in zip(_batches(len(coefs)), coefs):
            _loss(table, ids).backward()
            opt.sync_grads()
            opt.step(LR, clip_coef=c if clip else 1.0)
        return table.detach()

    table = torch.nn.Parameter(torch.randn(VOCAB, WIDTH, generator=torch.Generator()
                                           .manual_seed(1)))
    reference = torch.optim.AdamW([table], lr=LR, betas=BETAS, eps=1e-8, weight_decay=WD)
    for ids, c in zip(_batches(len(coefs)), coefs):
        reference.zero_grad()
        F.embedding(ids, table).sin().sum().backward()
        table.grad.mul_(c)
        reference.step()
    clipped = ours(clip=True)
    torch.testing.assert_close(clipped, table.detach(), atol=1e-6, rtol=1e-5)
    assert (clipped - ours(clip=False)).abs().max() > 1e-3


def test_the_norm_counts_each_touched_row_once():
    table = torch.nn.Parameter(torch.zeros(4, 2))
    opt = TableOptimizer([("t", table)], TableLayout(update="lazy", kernel="torch"), 1.0,
                         0.0, BETAS)
    F.embedding(torch.tensor([[1, 1, 3]]), table, sparse=True).sum().backward()
    opt.sync_grads()
    assert opt.grad_norm_sq() == pytest.approx(2 * 2 ** 2 + 2 * 1 ** 2)  # row 1 twice
    assert opt.touched_rows == 2


def test_device_placement_that_cannot_fit_the_node_is_refused_before_allocating(monkeypatch):
    """Every rank's fp32 master and Adam moments of its tables, times the node's ranks,
    against the node's available memory: a one-line ConfigError, not the OOM killer."""
    from megatron_stem.runtime.errors import ConfigError
    from megatron_stem.runtime.parallel import local_world_size
    from megatron_stem.tables import host_memory

    bf16 = [("t", torch.nn.Parameter(torch.zeros(1000, 64, dtype=torch.bfloat16)))]
    fp32 = [("t", torch.nn.Parameter(torch.zeros(1000, 64)))]
    from megatron_stem.tables.partition import cpu_state_bytes

    assert cpu_state_bytes(bf16) == 1000 * 64 * 12  # master + 2 moments
    assert cpu_state_bytes(fp32) == 1000 * 64 * 8  # the table is its master
    assert host_memory.available_host_bytes() > 0  # read from /proc/meminfo here
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: 8 * 1000 * 64 * 12 - 1)
    with pytest.raises(ConfigError, match=r"^tables\.placement: device keeps .* for 8 rank\(s\) "
                                          r"on this node, .* Use tables\.placement=host"):
        host_memory.check_table_memory(bf16, "device")
    host_memory.check_table_memory(fp32, "device")  # 8 bytes per element fit
    host_memory.check_table_memory(bf16, "host")  # one shared copy: not this check's business
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: None)  # unknown: no verdict
    host_memory.check_table_memory(bf16, "device")
    # srun without torchrun: tasks on this node from SLURM.
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "4(x2)")
    assert local_world_size() == 4


def test_interleaved_shards_balance_the_frequent_rows():
    """Shards own an interleaved sample of the vocabulary: the most frequent ids of a BPE
    vocabulary (its lowest) split evenly over any number of ranks, and the order is a
    permutation that does not depend on that number (checkpoints reshard)."""
    from megatron_stem.tables.shards import interleaved_order

    for vocab in (32000, 128256):
        order = interleaved_order(vocab)
        assert torch.equal(order.sort().values, torch.arange(vocab))
        for ranks in (2, 4, 8, 32):
            if vocab % ranks:
                continue
            low = (order.view(ranks, -1) < vocab // 20).sum(1)  # the 5% lowest ids
            assert low.max() - low.min() <= 0.05 * low.float().mean() + 2, (vocab, ranks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_finite_check_agrees_with_isfinite(dtype):
    """`all_finite` (a min and a max per tensor) answers as `isfinite(...).all()` for a NaN
    or either infinity anywhere, also past the first SIMD vector, and for no rows."""
    all_finite = table_optim.all_finite
    grads = [torch.randn(37, 96).to(dtype), torch.randn(5, 96).to(dtype),
             torch.empty(0, 96, dtype=dtype)]
    assert all_finite(grads).item() and all_finite([]).item()
    for bad in (float("nan"), float("inf"), float("-inf")):
        for table, where in ((0, (36, 95)), (1, (0, 0)), (0, (17, 41))):
            spoilt = [g.clone() for g in grads]
            spoilt[table][where] = bad
            assert not all(torch.isfinite(g).all() for g in spoilt)
            assert not all_finite(spoilt).item(), (bad, table, where)
