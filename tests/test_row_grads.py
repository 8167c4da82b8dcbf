"""A step's row gradients (training/row_grads.py): one order of additions for every placement."""

import pytest
import torch
import torch.nn.functional as F

from megatron_stem.training.host_tables import HostTableStore
from megatron_stem.training.row_grads import row_grads_of
from workers.common import HostTable

VOCAB, WIDTH = 40, 16


def _microbatches(count=3, seed=0):
    """Few ids, so rows repeat within and across micro-batches."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 12, (3, 7), generator=g) for _ in range(count)]


def _loss(rows: torch.Tensor, position_scale: torch.Tensor) -> torch.Tensor:
    return (rows.float().sin() * position_scale).sum()


def _reference(ids_per_mb, grads_per_mb, dtype):
    """Written out: per micro-batch each row's position gradients added one by one in
    position order (fp32), then the micro-batches' sums added in order; rounded once."""
    total = {}
    for ids, grads in zip(ids_per_mb, grads_per_mb):
        sums = {}
        for i, row in enumerate(ids.flatten().tolist()):
            g = grads.reshape(-1, WIDTH)[i].float()
            sums[row] = g.clone() if row not in sums else sums[row] + g
        for row, s in sums.items():
            total[row] = torch.zeros(WIDTH) + s if row not in total else total[row] + s
    rows = sorted(total)
    return torch.tensor(rows), torch.stack([total[r] for r in rows]).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_device_and_host_tables_sum_row_grads_in_one_order(dtype):
    """A device-placed table's sparse gradients (one per backward, via the parameter's
    hook) and a host-placed table's staged rows give the written-out sums bit for bit:
    fp32 accumulation rounded once to the training dtype, whatever that is."""
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(VOCAB, WIDTH, generator=g)
    scales = [torch.randn(3, 7, 1, generator=g) for _ in range(3)]
    mbs = _microbatches()

    device = torch.nn.Parameter(weight.to(dtype))
    sums = row_grads_of(device)
    position_grads = []
    for ids, scale in zip(mbs, scales):
        out = F.embedding(ids, device, sparse=True)
        out.retain_grad()
        _loss(out, scale).backward()
        position_grads.append(out.grad)
    assert device.grad is None  # every backward's gradient went to the RowGradSum
    device_rows, device_grads = sums.take()

    table = HostTable(weight.clone())
    store = HostTableStore([table], torch.device("cpu"), dtype)
    store.stage([{"tokens": ids} for ids in mbs])
    for ids, scale in zip(mbs, scales):
        inverse, rows = store.lookup(ids, table)
        _loss(F.embedding(inverse, rows, sparse=True), scale).backward()
    host_rows, (host_grads,) = store.take_row_grads()
    store.close()

    rows, expected = _reference(mbs, position_grads, dtype)
    assert torch.equal(device_rows, rows) and torch.equal(host_rows, rows)
    assert device_grads.dtype == host_grads.dtype == dtype
    assert torch.equal(device_grads, expected) and torch.equal(host_grads, expected)
    assert sums.take()[0].numel() == 0  # taken: the next step starts empty


def test_a_dense_table_gradient_is_refused():
    table = torch.nn.Parameter(torch.zeros(VOCAB, WIDTH))
    sums = row_grads_of(table)
    assert row_grads_of(table) is sums  # one per parameter, one hook
    with pytest.raises(RuntimeError, match=r"gradient is dense, of shape \(40, 16\): .*sparse_grad"):
        F.embedding(torch.tensor([[1, 2]]), table).sum().backward()
