"""A step's row gradients (tables/row_grads.py): one order of additions for every placement."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

from megatron_stem.tables.host_tables import HostTableStore
from megatron_stem.tables.row_grads import StepRows, row_grads_of
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
    host_rows, (host_grads,), looked_up = store.take_row_grads()
    store.close()

    rows, expected = _reference(mbs, position_grads, dtype)
    assert torch.equal(device_rows, rows) and torch.equal(host_rows, rows) and looked_up
    assert device_grads.dtype == host_grads.dtype == dtype
    assert torch.equal(device_grads, expected) and torch.equal(host_grads, expected)
    assert sums.take()[0].numel() == 0  # taken: the next step starts empty


def test_a_dense_table_gradient_is_refused():
    table = torch.nn.Parameter(torch.zeros(VOCAB, WIDTH))
    sums = row_grads_of(table)
    assert row_grads_of(table) is sums  # one per parameter, one hook
    with pytest.raises(RuntimeError, match=r"gradient is dense, of shape \(40, 16\): .*sparse_grad"):
        F.embedding(torch.tensor([[1, 2]]), table).sum().backward()


class _Streams:
    """A side stream's protocol (tables/streams.py) that records what is asked of
    it, and in which backward state."""

    def __init__(self):
        self.calls = []

    def hand_over(self, tensors):
        self.calls.append(("hand_over", [t.data_ptr() for t in tensors]))

    @contextlib.contextmanager
    def running(self):
        self.calls.append(("running",))
        yield

    def mark(self):
        self.calls.append(("mark",))
        return "event"

    def wait(self, event):
        self.calls.append(("wait", event))


def _staged_backwards(param, mbs, scales, streams, patch=None):
    """The step's backwards of `param` looked up with `mbs`, staged ahead with `streams`
    (None: unstaged), then `patch()`; what the streams saw when each backward returned."""
    sums = row_grads_of(param)
    if streams is not None:
        sums.expect(StepRows(mbs, torch.device("cpu")), streams)
    if patch is not None:
        patch()
    seen = []
    for ids, scale in zip(mbs, scales):
        _loss(F.embedding(ids, param, sparse=True), scale).backward()
        seen.append(list(streams.calls) if streams is not None else None)
    return sums, seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_staged_step_is_summed_as_its_last_backward_ends_with_no_sync(dtype, monkeypatch):
    """Rows known ahead: the sum is queued on the side stream when the last backward ends
    (not before: earlier backwards queue nothing), after the gradients are handed to it,
    with no `torch.unique` (on a GPU a host sync); `take` waits for its event and gives
    the unstaged sum's bits."""
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(VOCAB, WIDTH, generator=g).to(dtype)
    scales = [torch.randn(3, 7, 1, generator=g) for _ in range(3)]
    mbs = _microbatches(seed=3)
    plain, _ = _staged_backwards(torch.nn.Parameter(weight.clone()), mbs, scales, None)
    rows, grads = plain.take()

    streams = _Streams()
    staged = torch.nn.Parameter(weight.clone())
    unique = torch.unique
    sums, seen = _staged_backwards(staged, mbs, scales, streams, lambda: monkeypatch.setattr(
        torch, "unique", lambda *a, **k: pytest.fail("a sync in the sum")))
    assert seen[0] == seen[1] == []
    assert [c[0] for c in seen[2]] == ["hand_over", "running", "mark"]
    handed = set(seen[2][0][1])
    assert all(t.data_ptr() in handed for p in sums._parts for t in (p._indices(), p._values()))
    staged_rows, staged_grads = sums.take()
    assert streams.calls[-1] == ("wait", "event")
    monkeypatch.setattr(torch, "unique", unique)
    assert torch.equal(staged_rows, rows) and torch.equal(staged_grads, grads)
    assert sums._rows is None and sums.take()[0].numel() == 0  # the next step unstaged


def test_gradients_of_other_rows_than_staged_are_refused():
    """A lookup with ids other than the staged micro-batch's (a row outside its rows) is
    caught at `take`, not summed into a wrong row; so is a backward beyond the staged ones."""
    param = torch.nn.Parameter(torch.zeros(VOCAB, WIDTH))
    sums = row_grads_of(param)
    sums.expect(StepRows([torch.tensor([[1, 2, 3]])], torch.device("cpu")), _Streams())
    F.embedding(torch.tensor([[1, 2, 30]]), param, sparse=True).sum().backward()
    with pytest.raises(RuntimeError, match="other token ids than the micro-batches staged"):
        sums.take()
    sums.expect(StepRows([torch.tensor([[1, 2]])], torch.device("cpu")), _Streams())
    F.embedding(torch.tensor([[1, 2]]), param, sparse=True).sum().backward()
    with pytest.raises(RuntimeError, match="after the backwards of the micro-batches staged"):
        F.embedding(torch.tensor([[1]]), param, sparse=True).sum().backward()


def test_a_staged_sum_under_reentrant_recompute_gives_the_same_bits():
    """Megatron's recompute replays a layer's forward in its backward, a nested autograd
    pass (reentrant checkpointing): the last gradient's hook then queues the sum at the
    end of the nested pass, before the rest of the backward; the sum is the same."""
    from torch.utils.checkpoint import checkpoint

    g = torch.Generator().manual_seed(4)
    weight = torch.randn(VOCAB, WIDTH, generator=g)
    scales = [torch.randn(3, 7, 1, generator=g) for _ in range(3)]
    mbs = _microbatches(seed=5)
    results = []
    for staged in (False, True):
        param = torch.nn.Parameter(weight.clone())
        sums = row_grads_of(param)
        streams = _Streams()
        if staged:
            sums.expect(StepRows(mbs, torch.device("cpu")), streams)
        for ids, scale in zip(mbs, scales):
            x = torch.ones(1, requires_grad=True)  # (a reentrant checkpoint needs an input
            out = checkpoint(lambda x, ids=ids, p=param: F.embedding(ids, p, sparse=True) * x, x,
                             use_reentrant=True)   # that requires grad)
            _loss(out, scale).backward()
        assert (("mark",) in streams.calls) == staged  # queued by the last backward
        results.append(sums.take())
    assert results[1][1].numel()
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
