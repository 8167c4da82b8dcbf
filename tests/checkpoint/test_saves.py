"""A save: each rank writes only its share (its ZeRO partition of the dense optimizer
states, as boxes of the parameters' global tensors), hashes its files as it writes them
and fsyncs them; the commit fsyncs the folders, lists every rank's files in COMPLETE and
reads no file back; synchronous and background saves alike."""

from math import prod
from pathlib import Path

import pytest
import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

from megatron_stem import checkpoint
from megatron_stem.checkpoint import checksums
from megatron_stem.checkpoint.checkpointer import Checkpointer
from megatron_stem.checkpoint.commit import Writer
from megatron_stem.checkpoint.zero_state import _pieces, flat_boxes
from megatron_stem.config import ParallelConfig, Recipe, from_dict
from megatron_stem.model import build_model
from megatron_stem.training.engine import build_engine
from megatron_stem.training.loop import train_step
from workers.common import TINY, microbatches, tiny_model


@pytest.mark.parametrize("shape", [(7,), (5, 6), (3, 4, 5), (2, 3, 1, 4)])
def test_a_flat_range_is_a_few_contiguous_boxes(shape):
    """Every range [start, stop) of a row-major tensor, as `flat_boxes` cuts it: boxes in
    flat order, each contiguous in memory, covering the range exactly, at most 2 x dims - 1."""
    flat = torch.arange(prod(shape))
    tensor = flat.view(shape)
    for start in range(flat.numel() + 1):
        for stop in range(start, flat.numel() + 1):
            boxes = flat_boxes(shape, start, stop)
            parts = [tensor[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].flatten()
                     for offsets, sizes in boxes]
            assert torch.equal(torch.cat(parts) if parts else flat[:0], flat[start:stop])
            assert all(torch.equal(p, torch.arange(int(p[0]), int(p[0]) + p.numel()))
                       for p in parts)
            assert len(boxes) <= max(1, 2 * len(shape) - 1)


def test_a_swiglu_parameter_is_saved_as_its_two_halves(world1):
    """`linear_fc1` (gate rows, then up rows) is one global tensor whose gate half comes
    first for every TP rank: a box of the local tensor lands in the half it belongs to."""
    model = build_model(tiny_model(), ParallelConfig())
    fc1 = next(sh for sh in model.sharded_state_dict().values()
               if isinstance(sh, ShardedTensorFactory))
    rows, width = fc1.data.shape
    pieces = _pieces(fc1)
    assert [(piece.global_offset, piece.local_shape, first) for piece, first in pieces] == [
        ((0, 0), (rows // 2, width), 0), ((rows // 2, 0), (rows // 2, width), rows // 2 * width)]


def test_parts_a_factory_copies_are_found_by_their_elements_and_scattered_ones_refused():
    """A factory whose parts are not views of the parameter: a contiguous copy is placed
    by the elements it holds; a part of scattered elements cannot be a range of boxes."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    def factory(cut):
        def build(key, t, replica_id, flattened_range=None):
            return {name: ShardedTensor.from_rank_offsets(f"{key}.{name}", part.contiguous())
                    for name, part in cut(t).items()}
        return ShardedTensorFactory("w", torch.zeros(4, 3), build, lambda parts: parts)

    copied = _pieces(factory(lambda t: {"head": t[:1].clone(), "rest": t[1:].clone()}))
    assert [(piece.key, first) for piece, first in copied] == [("w.head", 0), ("w.rest", 3)]
    with pytest.raises(NotImplementedError, match="not contiguous ranges"):
        _pieces(factory(lambda t: {"columns": t[:, :2]}))


def _engine_recipe(save_dir: Path, async_save: bool) -> Recipe:
    return from_dict(Recipe, {
        "model": {**TINY, "stem_layers": "1/2"},
        "optimizer": {"lr": 1e-2, "warmup_steps": 0, "tables": {"kernel": "torch"}},
        "train": {"micro_batch_size": 2, "global_batch_size": 2, "dtype": "fp32",
                  "save_dir": str(save_dir), "async_save": async_save}})


def _rchar() -> int:
    return int(Path("/proc/self/io").read_text().split()[1])


@pytest.mark.parametrize("async_save", [False, True], ids=["synchronous", "background"])
def test_every_save_is_durable_before_complete_and_its_commit_reads_no_file(
        world1, tmp_path, monkeypatch, async_save):
    """Through the trainer's `Checkpointer.save`: every file and folder of the checkpoint
    is fsynced before COMPLETE is written, and the commit (`Writer.__exit__`) opens no file
    of the checkpoint to read and reads no more bytes of any file than this check's own."""
    import builtins
    import os

    recipe = _engine_recipe(tmp_path / "run", async_save)
    model = build_model(recipe.model, recipe.parallel, tables=recipe.tables)
    checkpointer = Checkpointer(recipe)
    checkpointer.load_weights(model)
    engine, tables, update = build_engine(model, recipe)
    checkpointer.resume(model, engine, tables)
    train_step(update, microbatches(tiny_model(), count=1), 1e-2)

    events, fsync, write_marker = [], os.fsync, checksums.write
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(
        os.readlink(f"/proc/self/fd/{fd}")), fsync(fd))[1])
    monkeypatch.setattr(checksums, "write", lambda marker, entries: (
        events.append(("COMPLETE", str(marker))), write_marker(marker, entries))[1])
    committing, opened, commit = [], [], Writer.__exit__
    open_ = builtins.open

    def watched_open(file, mode="r", *args, **kwargs):
        if committing and "r" in mode and str(tmp_path) in str(file):
            opened.append(str(file))
        return open_(file, mode, *args, **kwargs)

    def watched_commit(self, *args):
        committing.append(_rchar())
        try:
            return commit(self, *args)
        finally:
            committing.append(_rchar() - committing.pop())
    monkeypatch.setattr(builtins, "open", watched_open)
    monkeypatch.setattr(Writer, "__exit__", watched_commit)
    assert checkpointer.save(1, force=True)

    ckpt = tmp_path / "run" / "iter_0000001"
    assert opened == [] and committing[0] < 1024  # /proc/self/io itself: ~100 bytes
    complete = events.index(next(e for e in events if e[0] == "COMPLETE"))
    synced = set(events[:complete])
    tmp = str(ckpt) + ".tmp"
    files = [p for p in ckpt.rglob("*") if p.is_file() and p.name != "COMPLETE"]
    folders = [ckpt, *(p for p in ckpt.rglob("*") if p.is_dir())]
    assert len(files) == 13 and len(folders) == 3  # 3 + 5 in each dist checkpoint
    assert [p for p in files + folders
            if tmp + str(p)[len(str(ckpt)):] not in synced] == []


def _every_file(ckpt: Path) -> dict[str, dict]:
    return {str(p.relative_to(ckpt)): checksums.entry_of(p) for p in sorted(ckpt.rglob("*"))
            if p.is_file() and p.name not in ("COMPLETE", "recipe.yaml")}


@pytest.mark.integration  # the trainer runs under torchrun
@pytest.mark.parametrize("async_save", [False, True], ids=["synchronous", "background"])
def test_complete_lists_every_file_of_both_ranks_with_its_size_and_xxh3(train, async_save):
    """On two ranks each rank's files (its shard files of both dist checkpoints; rank 0's
    metadata, train state and code version) are in COMPLETE with their sizes and the
    xxh3 of their bytes as written, and a resume verifies them."""
    run = train(2, f"train.async_save={str(async_save).lower()}", "train.save_interval=3",
                name="complete")
    for step in (3, 6):
        ckpt = run["save_dir"] / checkpoint.iter_name(step)
        complete = checksums.read(ckpt / "COMPLETE")
        assert complete == _every_file(ckpt)
        for part in ("model", "optim"):
            writers = {name.split("/")[1].split("_")[2] for name in complete
                       if name.startswith(f"{part}/__")}
            assert writers == {"0", "1"}
        checkpoint.verify(ckpt)
