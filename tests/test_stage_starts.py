"""A run started from another run's weights (`train.init_from`): its STEM tables kept or
re-initialized (`train.init_tables`), and a STEM model started from its dense baseline,
whose STEM layers drop the dense up-projections and start fresh tables (what the
official code's `init_ckpt_path` amounts to)."""

import pytest
import torch

from conftest import merge_rank_dumps, torchrun
from megatron_stem import checkpoint
from megatron_stem.config import ParallelConfig, Recipe, TrainConfig
from megatron_stem.runtime.errors import UserError
from megatron_stem.model import build_model
from megatron_stem.checkpoint.checkpointer import Checkpointer
from workers.common import TINY, tiny_model

FFN = TINY["ffn_hidden_size"]


def _saved(folder, stem_layers, seed, **model):
    """A model of `stem_layers` built from `seed`, saved as a checkpoint under `folder`;
    returns its weights."""
    recipe = Recipe(model=tiny_model(stem_layers, **model))
    net = build_model(recipe.model, ParallelConfig(), seed=seed)
    with checkpoint.Writer(folder, 0, recipe) as out:
        checkpoint.save_model(net, out)
    return {k: v.clone() for k, v in net.state_dict().items() if "_extra_state" not in k}


def _started(source, stem_layers="1/2", init_tables="keep", seed=2):
    """A model of `stem_layers` built from `seed`, then loaded as `Checkpointer` loads
    `train.init_from=source`; returns (its weights, a fresh model's of the same seed)."""
    recipe = Recipe(model=tiny_model(stem_layers), train=TrainConfig(
        save_dir=str(source.parent / "run"), init_from=str(source), init_tables=init_tables))
    net = build_model(recipe.model, ParallelConfig(), seed=seed)
    fresh = {k: v.clone() for k, v in net.state_dict().items() if "_extra_state" not in k}
    Checkpointer(recipe).load_weights(net)
    return {k: v for k, v in net.state_dict().items() if "_extra_state" not in k}, fresh


@pytest.mark.parametrize("init_tables", ["keep", "reinit"])
def test_a_stem_start_keeps_or_reinitializes_the_tables(world1, tmp_path, init_tables):
    saved = _saved(tmp_path / "stage1", "1/2", seed=1)
    loaded, fresh = _started(tmp_path / "stage1", init_tables=init_tables)
    tables = [k for k in saved if ".mlp.table." in k]
    assert len(tables) == 2 and loaded.keys() == saved.keys()
    for name, value in saved.items():
        expected = fresh[name] if name in tables and init_tables == "reinit" else value
        assert torch.equal(loaded[name], expected), name
    assert not torch.equal(saved[tables[0]], fresh[tables[0]])  # the seeds' tables differ


def test_a_stem_model_starts_from_its_dense_baseline(world1, tmp_path):
    """Every weight of the dense checkpoint that the STEM model has is loaded as it is; a
    STEM layer's gate and down projections are the dense layer's (the up half of its fc1
    dropped); the tables are a fresh run's."""
    dense = _saved(tmp_path / "dense", "none", seed=1)
    loaded, fresh = _started(tmp_path / "dense")
    for name, value in loaded.items():
        if ".mlp.table." in name:
            expected = fresh[name]
        elif ".mlp.linear_gate." in name:
            expected = dense[name.replace("linear_gate", "linear_fc1")][:FFN]
        elif ".mlp.linear_down." in name:
            expected = dense[name.replace("linear_down", "linear_fc2")]
        else:
            expected = dense[name]
        assert torch.equal(value, expected), name
    assert any(".mlp.linear_gate." in k for k in loaded)


def test_a_dense_start_of_another_shape_or_with_its_optimizer_is_refused(world1, tmp_path):
    _saved(tmp_path / "wide", "none", seed=1, ffn_hidden_size=256)
    with pytest.raises(UserError, match=r"wide/iter_0000000/recipe\.yaml: the dense baseline of "
                                        r"another shape \(model\.ffn_hidden_size: checkpoint "
                                        r"256, recipe 128\)$"):
        _started(tmp_path / "wide")
    _saved(tmp_path / "dense", "none", seed=1)
    (tmp_path / "dense" / "iter_0000000" / "optim").mkdir()
    (tmp_path / "dense" / "iter_0000000" / "train_state.pt").write_bytes(b"")
    recipe = Recipe(model=tiny_model(), train=TrainConfig(
        save_dir=str(tmp_path / "run"), init_from=str(tmp_path / "dense" / "iter_0000000"),
        init_optimizer=True))
    with pytest.raises(UserError, match=r"^train\.init_optimizer: .* is a dense model's; a STEM"
                                        r" run starts from its weights only"):
        Checkpointer(recipe)


@pytest.mark.integration
def test_a_dense_start_at_tp2_cuts_each_ranks_gate_from_the_dense_fc1(world1, tmp_path):
    """Under tensor parallelism a rank's fc1 shard is [gate_r; up_r]: its STEM gate shard
    must be gate_r of the dense checkpoint saved at TP1."""
    dense = _saved(tmp_path / "dense", "none", seed=1)
    out = tmp_path / "tp2"
    out.mkdir()
    torchrun(2, "parity.py", "--out", out, "--tp", 2,
             "--load-dense", tmp_path / "dense" / "iter_0000000")
    params = merge_rank_dumps(out)["params"]
    gates = [k for k in params if ".mlp.linear_gate." in k]
    assert gates
    for name, value in params.items():
        if ".mlp.table." in name:
            continue
        expected = dense[name.replace("linear_gate", "linear_fc1")][:FFN] if name in gates \
            else dense[name.replace("linear_down", "linear_fc2")]
        assert torch.equal(value, expected), name
