"""The divergence guard (training/guard.py, training/update.py) in real torchrun/gloo
runs: a non-finite step is skipped on every rank, and a diverging run stops at its last
good checkpoint."""

import shutil

import pytest

from training_runs import assert_same_checkpoints

pytestmark = pytest.mark.integration  # the trainer runs under torchrun


def test_a_nan_in_one_ranks_table_gradient_skips_the_step_on_every_rank(train, tmp_path):
    """A NaN planted in rank 1's own table gradients at step 3: both ranks skip the step
    (the tables' norm is global), say whose it was, and change nothing: the checkpoints of
    steps 2 and 3 hold the same bits. The run goes on."""
    result = train(2, "train.save_interval=1", "train.keep_last=0", save_dir=tmp_path,
                   plant_nan=3, name="planted_nan")
    assert "step 3 | skipped: tables not finite (rank 1's table gradients); nothing was " \
           "updated (1 in a row; the run stops at 10)" in result["log"]
    assert result["step"] == 6 and result["losses"][3] == result["losses"][3]  # finite
    assert_same_checkpoints(tmp_path / "iter_0000003", tmp_path / "iter_0000002")
    # The optimizers applied 5 of the 6 steps: a resume continues their bias correction
    # from 5, as the run itself would.
    from megatron_stem.checkpoint.train_state import load_train_state

    assert load_train_state(tmp_path / "iter_0000006")["optimizer_steps"] == 5

def test_a_diverging_run_stops_at_its_last_good_checkpoint_and_resumes_from_it(
        train, reference, tmp_path):
    """The reference run (6 steps) continued at a learning rate high enough to diverge:
    its loss spikes, then its steps are not finite and are skipped with a line each; the
    run stops after `guard.max_skipped_steps` with one error line and a failed exit (2
    from each rank; torchrun's own 1), which no launcher requeues; the checkpoint before
    the first sign (a step's loss is that of the weights the step before it made)
    outlives `keep_last`, and a rerun with a sane learning rate resumes from it."""
    shutil.copytree(reference["lazy"]["save_dir"], tmp_path, dirs_exist_ok=True)
    # keep_last=2: the checkpoint before the step that spoilt the weights is still there
    # when the next step's loss shows it (one saved every step)
    diverging = ["optimizer.lr=1.0e+3", "guard.max_skipped_steps=2", "train.save_interval=1",
                 "train.keep_last=2", "train.steps=20"]
    first = train(2, *diverging, save_dir=tmp_path, name="diverging", exit_code=1)
    lines = first["log"].splitlines()
    spikes = [line for line in lines if "| loss spike:" in line]
    skips = [line for line in lines if "| skipped:" in line]
    assert spikes and len(skips) == 2, first["log"][-3000:]
    bad = int(skips[0].split()[1])
    good = tmp_path / "iter_0000006"  # the first spike is at step 8, after step 7's update
    assert spikes[0].startswith("step 8 | loss spike: ")
    parts = skips[-1].split("skipped: ")[1].split(" not finite")[0]
    assert [line for line in lines if line.startswith("error: ")] == [
        f"error: guard.max_skipped_steps: 2 steps in a row were skipped (steps {bad}-{bad + 1}: "
        f"{parts} not finite); latest now names the last good checkpoint, {good}: rerun to "
        "resume from it, with a lower learning rate (e.g. optimizer.lr=...) or another guard "
        "setting"]
    assert (good / "KEPT").is_file() and (tmp_path / "latest").read_text().strip() == good.name
    rescued = train(2, "optimizer.lr=1.0e-3", *diverging[1:], save_dir=tmp_path, name="rescued")
    assert rescued["step"] == 20 and len(rescued["losses"]) == 14
    assert all(loss < 10 for loss in rescued["losses"])  # finite, and learning again
