"""Host-resident tables (`tables.placement: host`): staging, ordering, cache, ownership.

The trainer end to end (host placement against the device-resident reference curve, DP=2
on one shared copy, recompute, cache) is in test_training_tables.py and
test_training_instruments.py, against the session's reference runs.
"""

import json
import time

import pytest
import torch
import torch.nn.functional as F

from support.processes import torchrun
from megatron_stem.config import ParallelConfig, Recipe, TableStorageConfig, from_dict
from megatron_stem.runtime.errors import ConfigError
from megatron_stem.model.row_cache import RowCache
from megatron_stem.tables import row_gather
from megatron_stem.tables.host_tables import HostTableStore, gather_rows
from megatron_stem.tables.row_grads import row_grads_of, take_same_rows
from megatron_stem.config.table_layout import TableLayout
from megatron_stem.tables.optimizer import TableOptimizer
from workers.common import TINY, HostTable, tiny_model

CPU = torch.device("cpu")


def zipf_ids(generator, shape, vocab, offset=0):
    """Zipf-like ids: rank r has probability ~ 1/(r+1), ranks shifted by `offset`."""
    p = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    ranks = torch.multinomial(p, shape[0] * shape[1], replacement=True, generator=generator)
    return ((ranks + offset) % vocab).view(shape)


@pytest.mark.parametrize("tables, message", [
    ({"cache_rows": 8}, r"tables\.cache_rows: needs placement: host"),
    ({"ranks_per_copy": 2}, r"tables\.ranks_per_copy: needs placement: host"),
    ({"placement": "host", "cache_rows": -1}, r"tables\.cache_rows: must be >= 0"),
    ({"placement": "host", "gather_threads": 0}, r"tables\.gather_threads: must be >= 1"),
    ({"placement": "host", "cache_rows": 301}, r"tables\.cache_rows: 301 rows exceed "
                                               r"model\.vocab_size=300"),
    ({"placement": "gpu"}, r"tables\.placement: expected one of \['device', 'host'\]"),
    ({"placement": "host", "overlap": "next_step"},
     r"tables\.overlap: next_step needs tables\.partition: sharded and tables\.placement: "
         r"device"),
    ({"partition": "replicated", "optimizer": {"device": "accelerator"}},
     r"optimizer\.tables\.device: accelerator needs tables\.partition: sharded"),
    ({"optimizer": {"kernel": "numpy"}}, r"optimizer\.tables\.kernel: expected one of"),
    ({"update": "lazy"}, r"tables\.update: moved to optimizer\.tables\.update"),
    ({"optimizer_device": "cpu"}, r"tables\.optimizer_device: moved to optimizer\.tables\.device"),
])
def test_config_errors_name_the_field(tables, message):
    """`tables` holds where the tables live; `optimizer.tables` how they are updated, where
    the keys that moved out of `tables` went."""
    tables = dict(tables)
    optimizer = {"tables": tables.pop("optimizer")} if "optimizer" in tables else {}
    with pytest.raises(ConfigError, match=message):
        from_dict(Recipe, {"model": TINY, "optimizer": optimizer, "tables": tables})


def test_threaded_gather_equals_index_select():
    table = torch.randn(5000, 16)
    ids = torch.randint(0, 5000, (3000,))
    out = torch.empty(3000, 16)
    with row_gather.ThreadPoolExecutor(3) as pool:
        gather_rows(table, ids, out, pool)
    assert torch.equal(out, table[ids])
    half = torch.empty(3000, 16, dtype=torch.bfloat16)  # staged in the compute dtype
    gather_rows(table, ids, half)
    assert torch.equal(half, table[ids].bfloat16())


def test_lfu_admits_hot_ids_evicts_cold_ones_and_ages():
    cache = RowCache(100, 3, [2], torch.float32, [CPU], decay=0.5)
    for _ in range(4):
        cache.observe(torch.tensor([1, 2, 3]))
    cache.observe(torch.tensor([4]))
    cache.plan()
    assert set(cache.id_of.tolist()) == {1, 2, 3}  # 4 is colder than every member
    for _ in range(3):  # 7 turns hot while the others are no longer seen and fade
        cache.observe(torch.tensor([7]))
        cache.plan()
    assert 7 in cache.id_of.tolist() and len(set(cache.id_of.tolist())) == 3
    assert cache.slots(torch.tensor([7]))[0] >= 0 and cache.slots(torch.tensor([4]))[0] < 0


@pytest.mark.parametrize("dense", [False, True], ids=["lazy", "dense"])
def test_cache_serves_exactly_the_table_rows_under_eviction_and_updates(dense):
    """Random Zipfian ids against a plain lookup of the current tables, while rows change
    between steps (some rows, or all of them as in `dense`) and the hot set moves (the
    cache must evict)."""
    vocab, width = 200, 6
    g = torch.Generator().manual_seed(0)
    tables = [HostTable(torch.randn(vocab, width, generator=g)) for _ in range(3)]
    store = HostTableStore(tables, CPU, torch.float32, cache_rows=16, gather_threads=3)
    members = []
    for step in range(36):
        offset = 0 if step < 12 else 100  # the hot ids change
        mbs = [{"tokens": zipf_ids(g, (2, 24), vocab, offset)} for _ in range(2)]
        store.stage(mbs)
        for mb in mbs:
            for t in tables:
                inverse, rows = store.lookup(mb["tokens"], t)
                assert torch.equal(F.embedding(inverse, rows), t.weight[mb["tokens"]])
        store.take_row_grads()
        # An optimizer step: some rows (or every row) change in the host tables.
        changed = None if dense else torch.randint(0, vocab, (20,), generator=g).unique()
        for t in tables:
            if dense:
                t.weight.data.add_(torch.randn(vocab, width, generator=g))
            else:
                t.weight.data[changed] += torch.randn(changed.numel(), width, generator=g)
        store.rows_changed(changed)
        store.wait_idle()
        members.append(set(store.cache.id_of.tolist()))
    stats = store.take_stats()
    store.close()
    assert 0.2 < stats["cache_hit_rate"] < 1 and stats["cache_token_hit_rate"] > \
        stats["cache_hit_rate"]  # hot ids repeat within a micro-batch
    assert len(members[11] - members[-1]) >= 12  # the old hot set was evicted ...
    assert set(range(100, 104)) <= members[-1]  # ... for the new hottest ids


@pytest.mark.parametrize("update, cache_rows", [("lazy", 0), ("lazy", 24), ("dense", 24)])
def test_rows_updated_at_step_k_are_seen_at_step_k_plus_1(update, cache_rows, monkeypatch):
    """With gradient accumulation (3 micro-batches per step), a slow optimizer and a slow
    gather: every micro-batch of step k reads exactly the tables as they were after step
    k-1's update (none of step k's), and the next micro-batch is staged while the current
    one runs (exactly one ahead)."""
    vocab, width = 64, 8
    g = torch.Generator().manual_seed(1)
    tables = [HostTable(torch.randn(vocab, width, generator=g)) for _ in range(2)]
    store = HostTableStore(tables, CPU, torch.float32, cache_rows=cache_rows, gather_threads=2)
    opt = TableOptimizer([(f"t{i}", t.weight) for i, t in enumerate(tables)],
                         TableLayout("host", update=update, kernel="torch"), 1.0, 0.1,
                         (0.9, 0.95), host=store)
    update_fast, gather_fast = opt.kernel.update, row_gather._gather_chunk

    def update_slowly(*args):  # a prefetch that did not wait for the step would read old rows
        time.sleep(0.005)
        update_fast(*args)

    def gather_slowly(*args):
        time.sleep(0.005)
        gather_fast(*args)

    monkeypatch.setattr(opt.kernel, "update", update_slowly)
    monkeypatch.setattr(row_gather, "_gather_chunk", gather_slowly)
    before = previous = None
    for step in range(4):
        version = [t.weight.detach().clone() for t in tables]
        if previous is not None:  # step k-1 really changed the rows it touched
            assert not torch.equal(version[0][previous], before[0][previous])
        mbs = [{"tokens": torch.cat([torch.arange(4).view(2, 2),  # ids in every micro-batch
                                     zipf_ids(g, (2, 10), vocab)], 1)} for _ in range(3)]
        opt.stage(mbs)
        for i, mb in enumerate(mbs):
            for t, rows_now in zip(tables, version):
                inverse, rows = store.lookup(mb["tokens"], t)
                assert torch.equal(F.embedding(inverse, rows), rows_now[mb["tokens"]])
                (F.embedding(inverse, rows, sparse=True).sin().sum()).backward()
            entries = store._entries
            assert all(e.future is not None for e in entries[:i + 2])  # one staged ahead ...
            assert all(e.future is None for e in entries[i + 2:])  # ... not more
        opt.sync_grads()
        with pytest.raises(RuntimeError, match="must land before the next micro-batches"):
            opt.stage(mbs)  # staging the next step before its update is refused
        opt.step(1e-2)
        before, previous = version, torch.unique(torch.cat([mb["tokens"].flatten() for mb in mbs]))
    assert store.take_stats()["prefetch_wait_ms"] > 0
    store.close()


def test_staged_rows_are_found_by_the_storage_of_the_ids():
    """Micro-batches sliced from one batch tensor share its storage: each finds its own
    rows. A view or a detached copy of a micro-batch's ids (the model's transpose,
    activation recompute) finds the same rows; equal ids in another tensor find none."""
    weight = torch.randn(30, 4)
    table = HostTable(weight.clone())
    store = HostTableStore([table], CPU, torch.float32)
    batch = torch.randint(0, 30, (4, 5), generator=torch.Generator().manual_seed(0))
    mbs = [{"tokens": batch[:2]}, {"tokens": batch[2:]}]
    store.stage(mbs, requires_grad=False)
    for mb in mbs:
        for ids in (mb["tokens"], mb["tokens"].t(), mb["tokens"].detach()):
            inverse, rows = store.lookup(ids, table)
            assert torch.equal(F.embedding(inverse, rows), weight[ids])
    with pytest.raises(RuntimeError, match="no staged rows for these token ids"):
        store.lookup(batch[:2].clone(), table)
    store.close()


def test_row_grads_are_the_summed_embedding_grads():
    vocab, width = 50, 4
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(vocab, width, generator=g)
    table = HostTable(weight.clone())
    store = HostTableStore([table], CPU, torch.float32)
    mbs = [{"tokens": torch.randint(0, vocab, (2, 9), generator=g)} for _ in range(3)]
    store.stage(mbs)
    reference = weight.clone().requires_grad_()
    for mb in mbs:
        inverse, rows = store.lookup(mb["tokens"], table)
        (F.embedding(inverse, rows, sparse=True).cos() * 3).sum().backward()
        (F.embedding(mb["tokens"], reference).cos() * 3).sum().backward()
    rows, (grad,), looked_up = store.take_row_grads()
    assert looked_up
    touched = torch.unique(torch.cat([mb["tokens"].flatten() for mb in mbs]))
    assert torch.equal(rows, touched)
    torch.testing.assert_close(grad, reference.grad[touched], rtol=1e-6, atol=1e-7)
    store.close()


# ---------------------------------------------------------------------------------------
# The megatron model with host tables
# ---------------------------------------------------------------------------------------


def _loss_and_grads(model, tokens, labels):
    loss = model(tokens, None, None, labels=labels).float().mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()
             if p.grad is not None and not getattr(p, "stem_table", False)}
    return loss.detach(), grads


@pytest.mark.parametrize("recompute", ["none", "full", "mlp", "mlp_act"])
def test_host_model_equals_device_model(world1, recompute):
    """Same init, same loss, same backbone grads and table row grads (bit for bit: both
    placements sum them the same way); under activation recompute the replayed forward
    finds the same staged rows."""
    from megatron_stem.model import build_model
    from megatron_stem.model.table import StemTable
    model_config = tiny_model("1/2")
    g = torch.Generator().manual_seed(3)
    seq = torch.randint(0, 300, (2, 33), generator=g)
    tokens, labels = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    torch.manual_seed(0)
    device_model = build_model(model_config, ParallelConfig())
    torch.manual_seed(0)
    selective = recompute.startswith("mlp")  # those modules of selective recompute
    parallel = ParallelConfig(recompute="selective", recompute_modules=[recompute]) \
        if selective else ParallelConfig(recompute=recompute)
    host_model = build_model(model_config, parallel, tables=TableStorageConfig(placement="host"))
    host = [m for m in host_model.modules() if isinstance(m, StemTable)]
    dev = [m for m in device_model.modules() if isinstance(m, StemTable)]
    assert len(host) == 2 and all(torch.equal(h.weight, d.weight) for h, d in zip(host, dev))
    assert all(not h.weight.requires_grad for h in host)
    for m in dev:
        m.sparse_grad = True
    dev_sums = [row_grads_of(m.weight) for m in dev]
    store = HostTableStore(host, CPU, torch.float32, cache_rows=20)
    with pytest.raises(RuntimeError, match="no staged rows for these token ids"):
        host_model(tokens, None, None, labels=labels)
    store.stage([{"tokens": tokens}])
    host_loss, host_grads = _loss_and_grads(host_model, tokens, labels)
    dev_loss, dev_grads = _loss_and_grads(device_model, tokens, labels)
    assert torch.equal(host_loss, dev_loss)
    assert host_grads.keys() == dev_grads.keys()
    for name in dev_grads:
        torch.testing.assert_close(host_grads[name], dev_grads[name], rtol=1e-6, atol=1e-8)
    rows, grads, _ = store.take_row_grads()
    assert torch.equal(rows, tokens.unique())
    assert all(m.weight.grad is None for m in dev)  # taken by the row-gradient hook
    dev_rows, dev_grads, _ = take_same_rows(dev_sums)
    assert torch.equal(dev_rows, rows)
    assert all(torch.equal(h, d) for h, d in zip(grads, dev_grads))
    store.close()


def test_host_tables_stay_on_the_host_through_moves_and_casts(world1):
    from megatron_stem.model import build_model
    from megatron_stem.model.table import StemTable
    model = build_model(tiny_model("1/2"), ParallelConfig(),
                        tables=TableStorageConfig(placement="host"))
    tables = [m.weight for m in model.modules() if isinstance(m, StemTable)]
    model.to(torch.bfloat16)
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tables)
    assert model.decoder.layers[0].mlp.linear_fc1.weight.dtype == torch.bfloat16


@pytest.mark.integration
@pytest.mark.parametrize("kernel", ["torch", "deepspeed"])
def test_shared_copy_and_row_owners_on_two_ranks(tmp_path, kernel):
    """Two data-parallel ranks: one host copy shared by both (each updates its own rows),
    and two copies (one per rank, synced by the cross-copy all-reduce), each with the
    optimizer state replicated or sharded over the ranks, and device tables with sharded
    state, give exactly the tables and Adam moments of device-resident tables with
    replicated state, for both update semantics and both table kernels (each owner
    updates other slices of the rows than a device rank), with the same grad norms."""
    out = tmp_path / "result.json"
    torchrun(2, "host_tables_worker.py", out, kernel)
    result = json.loads(out.read_text())
    assert result["copy_sizes"] == {"shared": 2, "per_rank": 1, "shared_sharded": 2,
                                    "per_rank_sharded": 1}
    assert len(result["max_diff"]) == 2 * 5
    assert result["owners_disjoint"] and result["shared_memory_seen"]
    assert result["leftover_shm_files"] == []
    for case, diff in result["max_diff"].items():
        assert diff == 0.0, case  # tables and moments bit for bit
        assert result["norm_rel_diff"][case] == 0.0, case
