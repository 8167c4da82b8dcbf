"""Stages: a run initialized from another run's checkpoint (torchrun/gloo, tiny model),
with or without its optimizer states, at another layout or sequence length."""


import numpy as np
import pytest

from conftest import tensorboard_steps
from training_runs import assert_same_curve, write_documents

pytestmark = pytest.mark.integration  # the trainer runs under torchrun


@pytest.fixture(scope="module")
def second_data(tmp_path_factory):
    """400 documents of another kind (a repeated short motif), for a blend of two prefixes."""
    def motifs(rng):
        return np.tile(rng.integers(0, 290, rng.integers(2, 6)), rng.integers(5, 20))

    return write_documents(str(tmp_path_factory.mktemp("data2") / "motifs"), 1, motifs)

@pytest.fixture(scope="module")
def midtrain(train, reference, toy_data, second_data, tmp_path_factory):
    """Stage 2 of a tiny pipeline whose stage 1 is the reference run: from stage 1's last
    checkpoint with its optimizer states, on a blend of two prefixes (a data recipe), with
    a schedule and seed of its own."""
    blend = tmp_path_factory.mktemp("blend") / "midtrain.yaml"
    blend.write_text(f"sources:\n  - {{prefix: {toy_data}, weight: 0.7}}\n"
                     f"  - {{prefix: {second_data}, weight: 0.3}}\n")
    options = ["data.prefixes=[]", f"data.blend={blend}", "optimizer.lr=1.0e-3",
               "optimizer.warmup_steps=1", "train.seed=7",
               f"train.init_from={reference['lazy']['save_dir'] / 'iter_0000006'}"]
    with_states = [*options, "train.init_optimizer=true"]
    return {"options": with_states, "weights_only": options,
            "run": train(1, *with_states, name="midtrain")}

def test_three_stages_pretrain_midtrain_on_a_blend_then_4x_the_sequence(train, reference,
                                                                        midtrain):
    """Each stage starts from the last checkpoint of the one before (stage 3 at 4x the
    sequence length, another RoPE base and with cross-document masking), trains its own
    steps into its own folder and logs, and leaves the folder it started from as it was."""
    stage1, stage2 = reference["lazy"], midtrain["run"]
    before = sorted(p.relative_to(stage2["save_dir"])
                    for p in stage2["save_dir"].rglob("*") if p.is_file())
    stage3 = train(1, "model.seq_length=128", "model.rotary_base=40000",
                   "data.reset_position_ids=true", "data.reset_attention_mask=true",
                   f"train.init_from={stage2['save_dir']}", "train.init_optimizer=true",
                   name="long_context")
    assert sorted(p.relative_to(stage2["save_dir"])
                  for p in stage2["save_dir"].rglob("*") if p.is_file()) == before
    for stage, origin in ((stage2, stage1), (stage3, stage2)):
        source = origin["save_dir"] / "iter_0000006"
        assert f"initialized from {source} (weights and optimizer states)" in stage["log"]
        assert stage["step"] == 6 and len(stage["losses"]) == 6  # a new run: steps 1..6
        assert tensorboard_steps(stage["save_dir"] / "tensorboard", "train/loss") == \
            [1, 2, 3, 4, 5, 6]
        # It starts where the stage before ended, below a fresh model's first loss.
        assert stage["losses"][0] < stage1["losses"][0] - 0.1
        assert stage["losses"][-1] < stage["losses"][0]
    saved = (stage3["save_dir"] / "iter_0000006" / "recipe.yaml").read_text()
    assert "seq_length: 128" in saved and "rotary_base: 40000.0" in saved

def test_a_stage_initialized_at_another_layout_follows_the_same_curve(train, midtrain,
                                                                      tmp_path):
    """Stage 2 on two ranks, the tables' optimizer state now sharded over both (stage 1
    kept it whole on one rank), killed at step 3 and resumed: the single-rank stage 2's
    curve. (The resume restores the Adam step count stage 2 carried on from stage 1.)"""
    first = train(2, *midtrain["options"], save_dir=tmp_path, preempt_at=3, name="mid_dp2")
    second = train(2, *midtrain["options"], save_dir=tmp_path, name="mid_dp2_resumed")
    assert first["step"] == 3 and second["step"] == 6
    assert_same_curve(first["losses"] + second["losses"], midtrain["run"]["losses"])

def test_init_from_without_the_optimizer_starts_a_fresh_one(train, midtrain):
    """Weights only: the same weights see the same first batch, then a fresh optimizer
    (Adam moments of zero, step 1) takes other steps than the carried-over states."""
    fresh = train(1, *midtrain["weights_only"], name="init_from_weights")
    assert "(weights)" in fresh["log"]
    carried = midtrain["run"]["losses"]
    assert fresh["step"] == 6 and fresh["losses"][0] == carried[0]
    assert all(abs(a - b) > 1e-4 for a, b in zip(fresh["losses"][1:], carried[1:]))


def test_a_stem_run_starts_from_a_dense_runs_checkpoint_and_trains(train, reference):
    """The dense baseline's last checkpoint starts the STEM model (its STEM layers' up
    projections dropped, fresh tables: tests/test_stage_starts.py checks the weights): the
    run starts below a fresh STEM model's first loss and trains on."""
    dense = train(1, "model.stem_layers=none", name="dense_stage1")
    stem = train(1, f"train.init_from={dense['save_dir']}", name="stem_from_dense")
    source = dense["save_dir"] / "iter_0000006"
    assert f"initialized from {source} (a dense model's weights: STEM layers' " \
           "up-projections dropped, fresh tables)" in stem["log"]
    assert stem["step"] == 6 and stem["losses"][-1] < stem["losses"][0]
    assert stem["losses"][0] < reference["lazy"]["losses"][0] - 0.1
