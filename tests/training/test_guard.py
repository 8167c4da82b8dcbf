"""The divergence guard's rules (training/guard.py) and the checkpoints it keeps.

The divergence guard (training/guard.py, training/update.py) in real torchrun/gloo
runs: a non-finite step is skipped on every rank, and a diverging run stops at its last
good checkpoint."""

import math
import shutil

import pytest

from megatron_stem.checkpoint import layout
from megatron_stem.config import GuardConfig, Recipe, from_dict
from megatron_stem.runtime.errors import ConfigError
from megatron_stem.training.guard import Diverged, Guard
from megatron_stem.training.update import GradNorms, Outcome
from support.training_runs import assert_same_checkpoints
from workers.common import TINY

APPLIED = Outcome(GradNorms(1.0, 1.0, 2 ** 0.5))
SKIPPED = Outcome(GradNorms(math.nan, 1.0, math.inf), ("backbone",))


class Run:
    """A guard with its hand-offs recorded."""

    def __init__(self, **config):
        self.lines, self.pinned, self.rewound = [], [], []
        self.guard = Guard(GuardConfig(**config), self.pin, self.rewound.append,
                           lambda step, line: self.lines.append(line))

    def pin(self, step):
        self.pinned.append(step)
        return f"ckpt/iter_{step - 1:07d}"


def test_skips_in_a_row_stop_the_run_at_the_last_good_checkpoint():
    run = Run(max_skipped_steps=3, spike_window=1)  # one healthy step ends an incident
    run.guard.after(1, 2.0, APPLIED)
    run.guard.after(2, math.nan, SKIPPED, " (rank 1's loss)")
    run.guard.after(3, 1.9, APPLIED)  # a good step ends the run of skips
    run.guard.after(4, math.nan, SKIPPED)
    run.guard.after(5, math.nan, SKIPPED)
    assert run.lines[0] == ("step 2 | skipped: backbone not finite (rank 1's loss); nothing "
                            "was updated (1 in a row; the run stops at 3)")
    assert run.pinned == [1, 3]  # before the step that made the weights of each first skip
    with pytest.raises(Diverged, match=r"^guard\.max_skipped_steps: 3 steps in a row were "
                                       r"skipped \(steps 4-6: backbone not finite\); latest "
                                       r"now names the last good checkpoint, "
                                       r"ckpt/iter_0000002: rerun to resume from it"):
        run.guard.after(6, math.nan, SKIPPED)
    assert run.rewound == ["ckpt/iter_0000002"]


def test_a_spike_is_logged_against_the_median_and_stops_only_when_asked():
    run = Run(spike_factor=2.0, spike_window=4)
    for step, loss in enumerate([5.0, 4.0, 4.2, 3.9, 3.8], start=1):  # none is 2 x before
        run.guard.after(step, loss, APPLIED)
    run.guard.after(6, 8.5, APPLIED)  # over 2 x the median 3.95 of 4.0, 4.2, 3.9, 3.8
    run.guard.after(7, 7.9, APPLIED)  # the spike raised the median only to 4.05: not one
    assert run.lines == [
        "step 6 | loss spike: 8.5000 is 2.2 x the median 3.9500 of the last 4 steps"]
    assert run.pinned == [5]
    stopping = Run(spike_factor=2.0, spike_window=2, stop_on_spike=True)
    stopping.guard.after(1, 4.0, APPLIED)
    with pytest.raises(Diverged, match=r"^guard\.stop_on_spike: the loss spiked at step 3"):
        stopping.guard.after(3, 9.0, APPLIED)


def test_without_a_checkpoint_before_the_skips_it_says_so():
    run = Run(max_skipped_steps=1)
    run.pin = lambda step: None
    run.guard.pin = run.pin
    with pytest.raises(Diverged, match="no checkpoint was saved before it"):
        run.guard.after(1, math.nan, SKIPPED)


@pytest.mark.parametrize("guard, message", [
    ({"max_skipped_steps": 0}, r"guard\.max_skipped_steps: must be >= 1"),
    ({"spike_factor": 0.5}, r"guard\.spike_factor: must be above 1 \(or 0: off\)"),
])
def test_bad_guard_settings_name_the_field(guard, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(Recipe, {"model": TINY, "guard": guard})


def test_prune_leaves_the_kept_checkpoint(tmp_path):
    from megatron_stem import checkpoint

    for step in range(1, 6):
        folder = tmp_path / checkpoint.iter_name(step)
        folder.mkdir()
        (folder / checkpoint.COMPLETE).write_text("{}")
    good = layout.last_before(tmp_path, 3)
    (good / layout.KEPT).write_text("kept")
    layout.prune(tmp_path, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoint.iter_name(2),
                                                          checkpoint.iter_name(5)]
    checkpoint.point_latest(tmp_path, good)
    assert (tmp_path / checkpoint.LATEST).read_text().strip() == checkpoint.iter_name(2)


@pytest.mark.integration  # the trainer runs under torchrun
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

@pytest.mark.integration  # the trainer runs under torchrun
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
