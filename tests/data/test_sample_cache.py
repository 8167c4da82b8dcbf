"""The training data at scale (data/sample_cache.py, data/prefix_sets.py): the same samples
as megatron-core's own builder, prefix sets, over-large prefixes refused, a shared cache
built once and loaded with no per-document memory, batches read ahead."""

import contextlib
import gc
import json
import math
import multiprocessing
import os
import struct
import threading
import time
import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.indexed_dataset import _IndexReader
from megatron.core.datasets.utils import Split

from megatron_stem.config import DataConfig, DataSource, ModelConfig, Recipe, TrainConfig
from megatron_stem.data.prefix_sets import MANIFEST, MAX_DOCUMENTS, resolve_blend
from megatron_stem.runtime.errors import UserError
from megatron_stem.data import sample_cache
from support.token_files import EOD, write_prefix, write_set
from megatron_stem.runtime import page_cache
from megatron_stem.training.batches import (Prefetcher, Samples, StepBatches,
                                            check_training_data, check_validation_sets,
                                            load_datasets, open_datasets, plans)

MODEL = ModelConfig(vocab_size=512, seq_length=16, hidden_size=8, num_layers=1,
                    num_attention_heads=1, ffn_hidden_size=16)
TOKENIZER = SimpleNamespace(eod=EOD, pad=-1, vocab_size=MODEL.vocab_size,
                            unique_identifiers={"class": "data-cache-test", "eod": EOD})


def recipe(tmp_path, **data) -> Recipe:
    data.setdefault("cache_dir", str(tmp_path / "cache"))
    return Recipe(model=MODEL, data=DataConfig(**data),
                  train=TrainConfig(seed=5, steps=6, global_batch_size=4, micro_batch_size=2,
                                    eval_iters=2))


def samples(dataset, count: int) -> list[list[int]]:
    return [dataset[i]["tokens"].tolist() for i in range(count)]


class single_process_group:
    """A one-process gloo group where none exists, for megatron's builder (its
    BlendedDataset asks for the rank)."""

    def __enter__(self):
        self.made = not torch.distributed.is_initialized()
        if self.made:
            torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(),
                                                 rank=0, world_size=1)

    def __exit__(self, *exc):
        if self.made:
            torch.distributed.destroy_process_group()


def megatron_datasets(r: Recipe, sizes: list, tmp_path, **blend):
    from megatron_stem.data.sample_cache import dataset_config

    config = dataset_config(r.train.seed, r.model.seq_length, TOKENIZER,
                            str(tmp_path / "megatron-cache"), r.data, **blend)
    with single_process_group():
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
    documents = write_set(tmp_path / "set", [120, 40, 80], seed=3)
    write_prefix(tmp_path / "other", 50, seed=9)
    prefixes, weights = resolve_blend([str(tmp_path / "set"), str(tmp_path / "other")],
                                      [0.8, 0.2], lambda i: f"sources[{i}]")
    manifest = json.loads((tmp_path / "set" / MANIFEST).read_text())["prefixes"]
    tokens = [p["tokens"] for p in manifest]
    assert [p.path for p in prefixes[:3]] == [str(tmp_path / "set" / p["name"]) for p in manifest]
    assert weights == pytest.approx([0.8 * t / sum(tokens) for t in tokens] + [0.2])
    assert sum(p.documents for p in prefixes[:3]) == documents
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


def test_a_prefix_set_with_a_prefix_past_int32_document_ids_says_to_cut_smaller(tmp_path):
    (tmp_path / "set").mkdir()
    sparse_prefix(tmp_path / "set" / "00000-00000", MAX_DOCUMENTS + 1)
    (tmp_path / "set" / MANIFEST).write_text(json.dumps({"format": 1, "prefixes": [
        {"name": "00000-00000", "documents": MAX_DOCUMENTS + 1, "tokens": 0}]}))
    with pytest.raises(UserError) as e:
        open_datasets(recipe(tmp_path, prefixes=[str(tmp_path / "set")]), TOKENIZER,
                      Samples(8, 4))
    assert str(e.value) == (
        f"data.prefixes: {tmp_path / 'set' / '00000-00000'} holds 2,147,483,648 documents, "
        "more than megatron-core's int32 document ids allow (2,147,483,647); preprocess it "
        "again with a lower --prefix-max-documents")


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
    sample_cache.prepare(list(again.values()), rank=0, build_command="x")
    assert cache_files(tmp_path) == before  # nothing rebuilt, nothing rewritten


def test_a_killed_build_is_redone_not_read(tmp_path):
    write_prefix(tmp_path / "p", 200, seed=1)
    r = recipe(tmp_path, prefixes=[str(tmp_path / "p")])
    (plan,) = plans(r, TOKENIZER, Samples(40, 8)).values()
    sample_cache.build([plan])
    expected = samples(plan.datasets()[0], 40)
    for path in (tmp_path / "cache").glob("*-train-*"):
        if path.name.endswith("-ready"):
            path.unlink()  # as if killed before it was marked
        elif path.name.endswith("shuffle_index.npy"):
            path.write_bytes(path.read_bytes()[:100])  # half-written
    assert not plan.ready()
    sample_cache.build([plan])
    assert samples(plans(r, TOKENIZER, Samples(40, 8))[None].datasets()[0], 40) == expected


def test_a_large_missing_cache_is_refused_on_every_rank(tmp_path, monkeypatch):
    write_prefix(tmp_path / "p", 200, seed=1)
    run_plans = list(plans(recipe(tmp_path, prefixes=[str(tmp_path / "p")]), TOKENIZER,
                           Samples(40, 8)).values())
    monkeypatch.setattr(sample_cache, "BUILD_AT_START_LIMIT_S", 1e-9)
    for rank in (0, 1):
        with pytest.raises(UserError, match=r"data.cache_dir: the sample indices of this run's "
                           r"data \(200 documents in 1 prefixes\) are not in .*: build them "
                           r"first with python tools/build_data_cache.py"):
            sample_cache.prepare(run_plans, rank, "python tools/build_data_cache.py --recipe r.yaml")
    assert not (tmp_path / "cache").exists()


def a_ranks_start(r: Recipe, samples: Samples) -> None:
    """What a rank does with the data before its first step (training/loop.py `_data`):
    the checks, the plans, the cache's state, the datasets, its first batches."""
    check_training_data(r.data, MODEL.vocab_size)
    check_validation_sets(r.data, MODEL.vocab_size)
    run_plans = plans(r, TOKENIZER, samples)
    sample_cache.prepare(list(run_plans.values()), 0, "x")
    train, sets = load_datasets(run_plans, r.data.split_validates)
    StepBatches(train, 2, 4, 0, 1, torch.device("cpu")).host(0)
    for dataset in sets.values():
        StepBatches(dataset, 2, samples.valid, 0, 1, torch.device("cpu")).host(0)


def test_a_start_builds_only_the_indices_it_lacks(tmp_path, monkeypatch, capsys):
    """Another rank count changes only the validation samples: a start then builds those
    alone, at a size (a stand-in cost per document) where building the whole cache would
    be refused, holding nothing per document of the training split, and reads the
    training indices already there."""
    documents = 100_000
    for i in range(2):
        write_prefix(tmp_path / f"p{i}", documents, seed=i)
    r = recipe(tmp_path, prefixes=[str(tmp_path / "p0"), str(tmp_path / "p1")],
               weights=[1.0, 2.0], split="98,2,0")
    sample_cache.build(list(plans(r, TOKENIZER, Samples(400, 8)).values()))
    before = cache_files(tmp_path)
    monkeypatch.setattr(sample_cache, "SECONDS_PER_DOCUMENT", 0.002)  # the whole: 400 s
    whole = plans(r, TOKENIZER, Samples(400, 16))[None]
    assert whole.build_seconds(whole.missing()) < sample_cache.BUILD_AT_START_LIMIT_S
    assert whole.build_seconds([sample_cache.Missing(0, 0), sample_cache.Missing(0, 1)]) > \
        sample_cache.BUILD_AT_START_LIMIT_S
    assert {m.split for m in whole.missing()} == {Split.valid.value}
    tracemalloc.start()
    sample_cache.prepare([whole], 0, "x")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4 * documents / 2  # the training split's ids would be 4 bytes a document
    assert capsys.readouterr().out.startswith("data cache: building 3 missing index(es) in ")
    after = cache_files(tmp_path)
    assert {k: v for k, v in after.items() if k in before} == before  # the rest untouched
    assert all("-valid-" in name for name in set(after) - set(before))
    _, sets = load_datasets(plans(r, TOKENIZER, Samples(400, 16)), True)
    theirs = megatron_datasets(r, [400, 16, 0], tmp_path, blend=(
        [str(tmp_path / "p0"), str(tmp_path / "p1")], [1.0, 2.0]), split="98,2,0")[1]
    assert samples(sets[None], 16) == samples(theirs, 16)


@pytest.mark.integration  # the trainer on 1 and 2 ranks
def test_a_run_on_another_rank_count_builds_its_validation_indices_and_trains(train, tmp_path):
    """A run on 2 ranks after one on 1 lacks only its validation indices (its validation
    batches are twice as many): with a stand-in cost that puts the whole cache past the
    limit (400 documents at a second each), its start builds them and it trains; a run
    without the cache is refused, before it builds its model."""
    cache, stand_in = tmp_path / "cache", ("--cost-per-document", "1", "--say-model-built")
    train(1, f"data.cache_dir={cache}", name="one_rank")
    refused = train(2, f"data.cache_dir={tmp_path / 'empty'}", worker=stand_in, exit_code=1,
                    name="refused")
    assert "error: data.cache_dir: the sample indices of this run's data (400 documents in 1 " \
           "prefixes) are not in " in refused["log"]
    assert "model built" not in refused["log"]
    two = train(2, f"data.cache_dir={cache}", worker=stand_in, name="two_ranks")
    assert f"data cache: building 1 missing index(es) in {cache}" in two["log"]
    assert two["log"].count("model built") == 2 and len(two["losses"]) == 6
    assert all(math.isfinite(loss) for loss in two["losses"] + two["valid"])


def test_a_whole_cache_is_read_by_every_rank_at_once(tmp_path, monkeypatch):
    """No rank waits for another when the cache is whole; a rank that finds indices missing
    waits for rank 0 to mark them ready, and no longer."""
    write_prefix(tmp_path / "p", 300, seed=1)
    r = recipe(tmp_path, prefixes=[str(tmp_path / "p")])
    sample_cache.build(list(plans(r, TOKENIZER, Samples(40, 8)).values()))
    monkeypatch.setattr(time, "sleep", lambda s: pytest.fail("a whole cache waited"))
    for rank in (0, 1, 7):
        sample_cache.prepare(list(plans(r, TOKENIZER, Samples(40, 8)).values()), rank, "x")
    monkeypatch.undo()
    missing = list(plans(r, TOKENIZER, Samples(40, 12)).values())  # another rank count
    rank0 = threading.Timer(0.5, sample_cache.prepare, (missing, 0, "x"))
    rank0.start()
    started = time.monotonic()
    sample_cache.prepare(list(plans(r, TOKENIZER, Samples(40, 12)).values()), 1, "x",
                         poll_s=0.05)
    assert 0.4 < time.monotonic() - started < 10
    rank0.join()


def test_a_filesystem_without_file_locks_is_one_line(tmp_path, monkeypatch):
    """Lustre mounted `noflock` refuses the build lock: the JIT ops' answer, not a trace."""
    import errno
    import fcntl

    def refuse(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    write_prefix(tmp_path / "p", 200, seed=1)
    run_plans = list(plans(recipe(tmp_path, prefixes=[str(tmp_path / "p")]), TOKENIZER,
                           Samples(40, 8)).values())
    monkeypatch.setattr(fcntl, "flock", refuse)
    with pytest.raises(UserError) as e:
        sample_cache.build(run_plans)
    assert str(e.value) == (
        f"{tmp_path / 'cache' / '.build.lock'}: the data cache's build lock needs file locks, "
        "which its filesystem refuses (No locks available): put data.cache_dir on a "
        "filesystem with file locks (Lustre: mounted with flock)")


def build_unlocked(r: Recipe, samples: Samples, events=None) -> None:
    """A builder on another node of a filesystem whose locks are per node: its lock holds
    nothing back. With `events` (ready, go, half, finish): its first index file waits for
    `go` once it knows what to build, then stops half written until `finish`."""
    sample_cache.file_locks.held = lambda *args, **kwargs: contextlib.nullcontext()
    if events is not None:
        ready, go, half, finish = events
        save = np.save

        def held_back(path, array, *args, **kwargs):
            if not half.is_set():
                ready.set()
                go.wait(60)
                with open(path, "wb") as f:
                    f.write(b"\x93NUMPY half")
                half.set()
                finish.wait(60)
            save(path, array, *args, **kwargs)
        np.save = held_back
    sample_cache.build(list(plans(r, TOKENIZER, samples).values()))


def test_two_builders_that_no_lock_keeps_apart_leave_a_whole_cache(tmp_path):
    """Builder B finds the cache empty; builder A, on another node, builds and marks it
    whole; then B writes its first index file, and stops half way. A run reads the cache
    then, and after B finishes: megatron's samples both times, no file read half written."""
    paths = [str(tmp_path / "p0"), str(tmp_path / "p1")]
    for i, path in enumerate(paths):
        write_prefix(path, 400, seed=i)
    r = recipe(tmp_path, prefixes=paths, weights=[1.0, 2.0])
    theirs = megatron_datasets(r, [60, 8, 0], tmp_path, blend=(paths, [1.0, 2.0]),
                               split=r.data.split)[0]
    ctx = multiprocessing.get_context("fork")
    events = [ctx.Event() for _ in range(4)]
    ready, go, half, finish = events
    b = ctx.Process(target=build_unlocked, args=(r, Samples(60, 8), events))
    b.start()
    try:
        assert ready.wait(60)
        a = ctx.Process(target=build_unlocked, args=(r, Samples(60, 8)))
        a.start()
        a.join(60)
        assert a.exitcode == 0
        go.set()
        assert half.wait(60)
        train, _ = load_datasets(plans(r, TOKENIZER, Samples(60, 8)), True)
        assert samples(train, 60) == samples(theirs, 60)
    finally:
        go.set()
        finish.set()
        b.join(60)
    assert b.exitcode == 0
    again, _ = load_datasets(plans(r, TOKENIZER, Samples(60, 8)), True)
    assert samples(again, 60) == samples(theirs, 60)
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".building")]


def drop_pages(files: list[str]) -> None:
    """The files' pages out of memory. megatron's index reader keeps its last 8 readers
    alive (an lru_cache on `__getitem__`), and their mappings keep their pages in: let go."""
    _IndexReader.__getitem__.cache_clear()
    gc.collect()
    for path in files:
        page_cache.drop(path)


@pytest.mark.parametrize("weights", [None, [1.0, 3.0]], ids=["unweighted", "weighted"])
def test_a_start_does_nothing_per_document(tmp_path, weights):
    """No memory and no reads in proportion to the documents: megatron's builder holds an
    int32 per document, and its deferred datasets count their samples by reading every
    document's length (5.5 s cold at 100M documents; an unweighted blend and every
    validation set on every rank). Here the lengths' pages stay out of memory."""
    documents = 200_000
    paths = [str(tmp_path / name) for name in ("a", "b", "c", "d")]
    for i, path in enumerate(paths):
        write_prefix(path, documents, seed=i)
    r = recipe(tmp_path, prefixes=paths[:2], weights=weights, validation={"held": paths[2:]})
    samples = Samples(400, 8)
    sample_cache.build(list(plans(r, TOKENIZER, samples).values()))
    a_ranks_start(r, samples)  # once before: what it imports is not the start's
    drop_pages([f"{path}.idx" for path in paths])
    tracemalloc.start()
    a_ranks_start(r, samples)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < documents  # megatron's builder: 4 bytes a document (an int32 arange)
    lengths = 4 * documents  # bytes of an .idx's lengths; a batch reads a few pages
    assert all(page_cache.resident(f"{path}.idx") < lengths / 4 for path in paths)


def test_a_cold_batch_reads_a_few_pages_of_the_cache(tmp_path):
    """The cache's `.npy` indices are mapped with read-ahead off: a batch's samples read an
    entry or two of each, and bring in the pages they are on, not windows around them (a
    cold 16-sample batch read 215 MB with megatron's plain mapping)."""
    paths = [str(tmp_path / "p0"), str(tmp_path / "p1")]
    for i, path in enumerate(paths):
        write_prefix(path, 200_000, seed=i)
    r = recipe(tmp_path, prefixes=paths, weights=[1.0, 2.0])
    samples_ = Samples(100_000, 8)
    sample_cache.build(list(plans(r, TOKENIZER, samples_).values()))
    indices = sorted(str(p) for p in (tmp_path / "cache").glob("*.npy"))
    assert sum(os.path.getsize(p) for p in indices) > 4_000_000
    drop_pages(indices)
    train, _ = load_datasets(plans(r, TOKENIZER, samples_), True)
    StepBatches(train, 4, 8, 0, 1, torch.device("cpu")).host(0)  # 8 samples
    resident = sum(page_cache.resident(p) for p in indices)
    assert 0 < resident <= 8 * 8 * page_cache.PAGE  # a few entries of each of 5 files a sample


def test_the_loader_thread_reads_the_next_step_while_this_one_computes(tmp_path):
    """After step s's batches are handed over, step s+1's samples are read on the loader
    thread, before the step asks for them."""
    write_prefix(tmp_path / "p", 300, seed=4)
    train, _ = open_datasets(recipe(tmp_path, prefixes=[str(tmp_path / "p")]), TOKENIZER,
                             Samples(60, 8))
    reads = []

    class Recorded:
        config = train.config

        def __len__(self):
            return len(train)

        def __getitem__(self, i):
            reads.append((i, threading.current_thread().name))
            return train[i]

    batches = StepBatches(Recorded(), 2, 4, 0, 1, torch.device("cpu"))
    prefetcher = Prefetcher(batches, last_step=3)
    try:
        prefetcher.microbatches(0)
        prefetcher.pending[1].result(timeout=30)
        assert reads[:4] == [(i, threading.current_thread().name) for i in range(4)]
        assert [i for i, _ in reads[4:]] == [4, 5, 6, 7]
        assert all(thread.startswith("stem-loader") for _, thread in reads[4:])
        read = len(reads)
        prefetcher.microbatches(1)  # read already: step 2's next, on the loader thread
        prefetcher.pending[2].result(timeout=30)
        assert [i for i, _ in reads[read:]] == [8, 9, 10, 11]
        assert all(thread.startswith("stem-loader") for _, thread in reads[read:])
    finally:
        prefetcher.close()


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
