"""Checkpoint folders: atomic commit, `latest`, keep-last-k, clear errors."""

import multiprocessing

import pytest
import torch
from megatron.core.dist_checkpointing.strategies import filesystem_async

from megatron_stem import checkpoint
from megatron_stem.config import ParallelConfig, Recipe
from megatron_stem.runtime.errors import UserError
from megatron_stem.model import build_model
from megatron_stem.checkpoint.layout import prune
from workers.common import tiny_model


def test_model_round_trip_and_latest_pointer(world1, tmp_path):
    recipe = Recipe(model=tiny_model())
    model = build_model(recipe.model, ParallelConfig(), seed=1)
    for step in (10, 20, 30):
        with checkpoint.Writer(tmp_path, step, recipe) as folder:
            checkpoint.save_model(model, folder)
        prune(tmp_path, keep_last=2)
    assert (tmp_path / "latest").read_text().strip() == "iter_0000030"
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000020", "iter_0000030"]

    other = build_model(recipe.model, ParallelConfig(), seed=2)
    ckpt = checkpoint.resolve(tmp_path)
    assert checkpoint.read_recipe(ckpt) == recipe
    checkpoint.load_model(other, ckpt)
    for (name, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), name


def test_a_save_starts_no_interpreter(world1, tmp_path, monkeypatch):
    """megatron's writer returns its results through a queue made for async saves, by
    default a manager process started with spawn (an interpreter importing the training
    script again at each rank's first save); our saves are synchronous and keep it here."""
    monkeypatch.setattr(filesystem_async, "_results_queue", None)  # as in a fresh process
    recipe = Recipe(model=tiny_model())
    model = build_model(recipe.model, ParallelConfig(), seed=1)
    before = set(multiprocessing.active_children())
    with checkpoint.Writer(tmp_path, 1, recipe) as folder:
        checkpoint.save_model(model, folder)
    assert set(multiprocessing.active_children()) <= before
    assert checkpoint.latest(tmp_path).name == "iter_0000001"


def test_crash_mid_save_keeps_last_good_checkpoint(world1, tmp_path):
    recipe = Recipe(model=tiny_model())
    model = build_model(recipe.model, ParallelConfig())
    with checkpoint.Writer(tmp_path, 1, recipe) as folder:
        checkpoint.save_model(model, folder)
    with pytest.raises(RuntimeError, match="disk full"):
        with checkpoint.Writer(tmp_path, 2, recipe) as folder:
            raise RuntimeError("disk full")
    assert checkpoint.latest(tmp_path).name == "iter_0000001"
    with pytest.raises(UserError, match="not a complete megatron-stem checkpoint"):
        checkpoint.resolve(tmp_path / "iter_0000002.tmp")
    with pytest.raises(UserError, match="no such checkpoint folder"):
        checkpoint.resolve(tmp_path / "nope")


def test_other_model_shape_is_a_clear_error():
    a, b = Recipe(model=tiny_model()), Recipe(model=tiny_model("none"))
    with pytest.raises(UserError, match=r"model\.stem_layers: checkpoint '1/2', recipe 'none'"):
        checkpoint.check_same_shape(a, b, "ckpt")


def _in_layout(dist_folder, out, common_state_in_shards: bool):
    """`dist_folder` rewritten by `hf.dist_io.write_checkpoint` in the layout of megatron-core
    0.16.1-0.18 (common state in common.pt) or of 0.19+ (inside the shards)."""
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_stem.runtime import mcore_versions
    from megatron_stem.checkpoint.streaming import CheckpointReader, write_checkpoint

    reader = CheckpointReader(dist_folder)
    tensors = {k: (reader.shape(k), reader.dtype(k), lambda k=k: reader.read(k))
               for k in reader.keys()}
    extra = [k.rsplit("/shard_", 1)[0] for k in
             FileSystemReader(str(dist_folder)).read_metadata().state_dict_metadata
             if "_extra_state" in k]
    installed = mcore_versions.COMMON_STATE_IN_SHARDS
    mcore_versions.COMMON_STATE_IN_SHARDS = common_state_in_shards
    try:
        write_checkpoint(out, tensors, extra)
    finally:
        mcore_versions.COMMON_STATE_IN_SHARDS = installed


def _common_state(dist_folder):
    """A dist checkpoint's common state, read as the megatron-core that wrote it reads it."""
    import io

    import torch.distributed.checkpoint as dcp

    if (dist_folder / "common.pt").exists():
        return torch.load(dist_folder / "common.pt", weights_only=True)
    read = {"common_state/shard_0_1": io.BytesIO()}
    dcp.load(read, storage_reader=dcp.FileSystemReader(str(dist_folder)), no_dist=True)
    shards = read["common_state/shard_0_1"]  # the list of the shards' data, or its bytes
    if isinstance(shards, io.BytesIO):
        shards.seek(0)
        shards = torch.load(shards, weights_only=True)
    return shards[0]


def test_checkpoints_of_either_megatron_layout_load_or_are_refused_in_one_line(world1,
                                                                               tmp_path):
    """megatron-core 0.19 keeps a checkpoint's common state inside its shards, 0.16.1-0.18 in
    common.pt. The HF import writes either, the common state as megatron's own save has it.
    0.19 reads both; 0.16.1-0.18 refuse the newer one in one line (megatron's own load fails
    deep inside on the missing file). Whichever version is installed, both are checked."""
    from megatron_stem.runtime import mcore_versions

    recipe = Recipe(model=tiny_model())
    model = build_model(recipe.model, ParallelConfig(), seed=1)
    with checkpoint.Writer(tmp_path / "native", 1, recipe) as folder:
        checkpoint.save_model(model, folder)
    native = checkpoint.resolve(tmp_path / "native")
    assert (native / "model" / "common.pt").exists() != mcore_versions.COMMON_STATE_IN_SHARDS
    for in_shards in (False, True):
        written = tmp_path / f"in_shards_{in_shards}"
        _in_layout(native / "model", written / "model", in_shards)
        assert (written / "model" / "common.pt").exists() != in_shards
        assert _common_state(written / "model") == _common_state(native / "model")
        loaded = build_model(recipe.model, ParallelConfig(), seed=2)
        if in_shards and not mcore_versions.COMMON_STATE_IN_SHARDS:
            with pytest.raises(UserError, match=r"model: written by megatron-core 0.19 or "
                               r"newer, which keeps its common state inside the shards; this "
                               r"environment's megatron-core 0\.1[678]\.\d+ reads only"):
                checkpoint.load_model(loaded, written)
            continue
        checkpoint.load_model(loaded, written)
        for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b), name
