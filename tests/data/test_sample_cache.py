"""The training data at scale (data/sample_cache.py, data/prefix_sets.py): the same samples
as megatron-core's own builder, prefix sets, over-large prefixes refused, a shared cache
built once and loaded with no per-document memory, batches read ahead."""

import json
import os
import struct
import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

from megatron_stem.config import DataConfig, DataSource, ModelConfig, Recipe, TrainConfig
from megatron_stem.data.indexed import PartWriter
from megatron_stem.data.prefix_sets import MANIFEST, MAX_DOCUMENTS, resolve_blend
from megatron_stem.runtime.errors import UserError
from megatron_stem.data import sample_cache
from megatron_stem.training.batches import (Prefetcher, Samples, StepBatches, load_datasets,
                                         open_datasets, plans)

EOD = 1
MODEL = ModelConfig(vocab_size=512, seq_length=16, hidden_size=8, num_layers=1,
                    num_attention_heads=1, ffn_hidden_size=16)
TOKENIZER = SimpleNamespace(eod=EOD, pad=-1, vocab_size=MODEL.vocab_size,
                            unique_identifiers={"class": "data-cache-test", "eod": EOD})


def write_prefix(prefix, documents: int, seed: int) -> list[np.ndarray]:
    """A token file of `documents` random documents, each ended by EOD; returns them."""
    rng = np.random.default_rng(seed)
    docs = [np.append(rng.integers(2, MODEL.vocab_size, rng.integers(3, 40)), EOD)
            for _ in range(documents)]
    writer = PartWriter(str(prefix), np.uint16)
    writer.add(np.concatenate(docs), np.array([len(d) for d in docs]))
    writer.close(sync=False)
    return docs


def write_set(folder, sizes: list[int], seed: int) -> list[np.ndarray]:
    """A prefix set (folder, prefixes, manifest.json) as preprocessing writes it."""
    os.makedirs(folder)
    entries, docs = [], []
    for i, n in enumerate(sizes):
        part = write_prefix(folder / f"00000-{i:05d}", n, seed + i)
        entries.append({"name": f"00000-{i:05d}", "documents": n,
                        "tokens": int(sum(len(d) for d in part))})
        docs += part
    (folder / MANIFEST).write_text(json.dumps({"format": 1, "prefixes": entries}))
    return docs


def recipe(tmp_path, **data) -> Recipe:
    data.setdefault("cache_dir", str(tmp_path / "cache"))
    return Recipe(model=MODEL, data=DataConfig(**data),
                  train=TrainConfig(seed=5, steps=6, global_batch_size=4, micro_batch_size=2,
                                    eval_iters=2))


def samples(dataset, count: int) -> list[list[int]]:
    return [dataset[i]["tokens"].tolist() for i in range(count)]


def megatron_datasets(r: Recipe, sizes: list, tmp_path, **blend):
    from megatron_stem.data.sample_cache import dataset_config

    config = dataset_config(r.train.seed, r.model.seq_length, TOKENIZER,
                            str(tmp_path / "megatron-cache"), r.data, **blend)
    with sample_cache._single_process_group():  # its BlendedDataset asks for the rank
        return BlendedMegatronDatasetBuilder(
            sample_cache.GPTDataset, sizes, lambda: True, config).build()


@pytest.mark.parametrize("weights", [None, [0.3, 0.7]], ids=["by-size", "weighted"])
@pytest.mark.parametrize("count", [1, 2])
def test_the_same_samples_as_megatrons_builder(tmp_path, count, weights):
    if weights is not None and count == 1:
        weights = [1.0]
    paths = [str(tmp_path / f"p{i}") for i in range(count)]
    for i, p in enumerate(paths):
        write_prefix(p, 300 + 50 * i, seed=i)
    r = recipe(tmp_path, prefixes=paths, weights=weights, split="90,10,0")
    train, sets = open_datasets(r, TOKENIZER, Samples(40, 12))
    unread = None if weights is None else 0
    ours = megatron_datasets(r, [40, 12, unread], tmp_path,
                             blend=(paths, weights), split="90,10,0")
    assert len(train) == len(ours[0])
    assert samples(train, len(train)) == samples(ours[0], len(ours[0]))
    assert samples(sets[None], 12) == samples(ours[1], 12)


def test_a_validation_set_is_megatrons_too(tmp_path):
    paths = [str(tmp_path / "a"), str(tmp_path / "b")]
    for i, p in enumerate(paths):
        write_prefix(p, 100, seed=10 + i)
    r = recipe(tmp_path, prefixes=paths[:1], split="100,0,0", validation={"held": paths})
    _, sets = open_datasets(r, TOKENIZER, Samples(8, 12))
    theirs = megatron_datasets(r, [None, 12, None], tmp_path,
                               blend_per_split=[None, (paths, None), None])[1]
    assert samples(sets["held"], 12) == samples(theirs, 12)


def test_a_prefix_set_is_its_prefixes_weighted_by_tokens(tmp_path):
    docs = write_set(tmp_path / "set", [120, 40, 80], seed=3)
    write_prefix(tmp_path / "other", 50, seed=9)
    prefixes, weights = resolve_blend([str(tmp_path / "set"), str(tmp_path / "other")],
                                      [0.8, 0.2], lambda i: f"sources[{i}]")
    manifest = json.loads((tmp_path / "set" / MANIFEST).read_text())["prefixes"]
    tokens = [p["tokens"] for p in manifest]
    assert [p.path for p in prefixes[:3]] == [str(tmp_path / "set" / p["name"]) for p in manifest]
    assert weights == pytest.approx([0.8 * t / sum(tokens) for t in tokens] + [0.2])
    assert sum(p.documents for p in prefixes[:3]) == len(docs)
    # read as megatron reads those prefixes with those weights
    r = recipe(tmp_path, sources=[DataSource(str(tmp_path / "set"), 0.8),
                                  DataSource(str(tmp_path / "other"), 0.2)])
    train, _ = open_datasets(r, TOKENIZER, Samples(40, 4))
    theirs = megatron_datasets(r, [40, 4, 0], tmp_path, split=r.data.split,
                               blend=([p.path for p in prefixes], weights))[0]
    assert samples(train, 40) == samples(theirs, 40)


def test_an_unfinished_prefix_set_is_refused_naming_the_field(tmp_path):
    (tmp_path / "set").mkdir()
    with pytest.raises(UserError, match=r"data.prefixes: .*set has no manifest.json"):
        open_datasets(recipe(tmp_path, prefixes=[str(tmp_path / "set")]), TOKENIZER,
                      Samples(8, 4))


def sparse_prefix(prefix, documents: int) -> None:
    """An .idx whose header claims `documents` documents (its arrays sparse: no disk)."""
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, documents, documents + 1))
        f.truncate(34 + 20 * documents + 8)
    open(f"{prefix}.bin", "wb").close()


def test_a_prefix_past_int32_document_ids_is_refused_before_anything_is_built(tmp_path):
    sparse_prefix(tmp_path / "huge", MAX_DOCUMENTS + 1)
    r = recipe(tmp_path, sources=[DataSource(str(tmp_path / "huge"), 1.0)],
               blend=None)
    with pytest.raises(UserError) as e:
        open_datasets(r, TOKENIZER, Samples(8, 4))
    assert str(e.value).startswith(f"data.sources[0].prefix: {tmp_path / 'huge'} holds "
                                   "2,147,483,648 documents, more than megatron-core's int32")
    assert "prefix set" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "cache").exists()


def cache_files(tmp_path) -> dict:
    return {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cache").iterdir()}


def test_the_cache_is_built_once_and_reused(tmp_path):
    for i in range(2):
        write_prefix(tmp_path / f"p{i}", 200, seed=i)
    r = recipe(tmp_path, prefixes=[str(tmp_path / "p0"), str(tmp_path / "p1")],
               weights=[1.0, 2.0], cache_dir=None)
    run_plans = plans(r, TOKENIZER, Samples(40, 8))
    assert not any(p.ready() for p in run_plans.values())
    lines = []
    sample_cache.build(list(run_plans.values()), progress=lines.append)
    assert lines[0] == "2 prefix(es) to index, 1 worker(s)"
    assert all(p.ready() for p in run_plans.values())
    # the default cache sits beside the data: shared by the runs that read it
    assert run_plans[None].config.path_to_cache == str(tmp_path / "cache")
    before = cache_files(tmp_path)
    assert any(name.endswith("-ready") for name in before)
    again = plans(r, TOKENIZER, Samples(40, 8))  # a second run of the same data
    assert all(p.ready() for p in again.values())
    sample_cache.prepare(list(again.values()), rank=0, barrier=lambda: None, build_command="x")
    assert cache_files(tmp_path) == before  # nothing rebuilt, nothing rewritten


def test_a_killed_build_is_redone_not_read(tmp_path):
    write_prefix(tmp_path / "p", 200, seed=1)
    r = recipe(tmp_path, prefixes=[str(tmp_path / "p")])
    (plan,) = plans(r, TOKENIZER, Samples(40, 8)).values()
    sample_cache.build([plan])
    expected = samples(plan.datasets(deferred=True)[0], 40)
    for path in (tmp_path / "cache").glob("*-train-*"):
        if path.name.endswith("-ready"):
            path.unlink()  # as if killed before it was marked
        elif path.name.endswith("shuffle_index.npy"):
            path.write_bytes(path.read_bytes()[:100])  # half-written
    assert not plan.ready()
    sample_cache.build([plan])
    assert samples(plan.datasets(deferred=True)[0], 40) == expected


def test_a_large_missing_cache_is_refused_on_every_rank(tmp_path, monkeypatch):
    write_prefix(tmp_path / "p", 200, seed=1)
    run_plans = list(plans(recipe(tmp_path, prefixes=[str(tmp_path / "p")]), TOKENIZER,
                           Samples(40, 8)).values())
    monkeypatch.setattr(sample_cache, "BUILD_AT_START_LIMIT_S", 1e-9)
    waited = []
    for rank in (0, 1):
        with pytest.raises(UserError, match=r"data.cache_dir: the sample indices of this run's "
                           r"data \(200 documents in 1 prefixes\) are not in .*: build them "
                           r"first with python tools/build_data_cache.py"):
            sample_cache.prepare(run_plans, rank, lambda rank=rank: waited.append(rank),
                             "python tools/build_data_cache.py --recipe r.yaml")
    assert not waited and not (tmp_path / "cache").exists()


def test_loading_allocates_nothing_per_document(tmp_path):
    documents = 200_000
    write_prefix(tmp_path / "p", documents, seed=2)
    r = recipe(tmp_path, sources=[DataSource(str(tmp_path / "p"), 1.0)])
    run_plans = plans(r, TOKENIZER, Samples(400, 8))
    sample_cache.build(list(run_plans.values()))
    tracemalloc.start()
    train, _ = load_datasets(plans(r, TOKENIZER, Samples(400, 8)), True)
    train[5]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < documents  # megatron's builder: 4 bytes a document (an int32 arange)


def test_read_ahead_hands_over_the_same_batches_in_any_order(tmp_path):
    write_prefix(tmp_path / "p", 300, seed=4)
    train, _ = open_datasets(recipe(tmp_path, prefixes=[str(tmp_path / "p")]), TOKENIZER,
                             Samples(60, 8))
    batches = StepBatches(train, 2, 4, 1, 2, torch.device("cpu"))
    prefetcher = Prefetcher(batches, last_step=6)
    try:
        for step in (0, 1, 2, 4, 5, 3):  # in order, then a jump (a resume, a rewind)
            got, want = prefetcher.microbatches(step), batches.microbatches(step)
            assert [mb.keys() for mb in got] == [mb.keys() for mb in want]
            for a, b in zip(got, want):
                assert all(torch.equal(a[k], b[k]) for k in ("tokens", "labels", "loss_mask"))
        assert 6 not in prefetcher.pending  # nothing read past the last step
    finally:
        prefetcher.close()
