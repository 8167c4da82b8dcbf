"""Checkpoints written in the background (`train.async_save`, checkpoint/background.py): the
same files as a synchronous save, a kill while a save is being written loses nothing (the
run resumes from the checkpoint before it, bit-exactly), and a stop signal waits for the
save in flight before the requeue exit."""

import pytest

from megatron_stem import checkpoint
from support.training_runs import assert_same_checkpoints, assert_same_curve

pytestmark = pytest.mark.integration  # the trainer runs under torchrun

ASYNC = "train.async_save=true"


def test_async_saves_write_the_synchronous_checkpoint(train, reference):
    result = train(1, ASYNC, "train.save_interval=2", name="async")
    assert result["losses"] == reference["lazy"]["losses"]
    saved = sorted(p.name for p in checkpoint.iter_folders(result["save_dir"]))
    assert saved == ["iter_0000002", "iter_0000004", "iter_0000006"]
    assert (result["save_dir"] / "latest").read_text().strip() == "iter_0000006"
    assert_same_checkpoints(result["save_dir"] / "iter_0000006",
                            reference["lazy"]["save_dir"] / "iter_0000006")


def test_a_kill_during_a_background_save_resumes_from_the_one_before(train, reference,
                                                                      tmp_path):
    """Step 4's files are still being written when the rank is killed after step 5."""
    killed = train(1, ASYNC, "train.save_interval=2", save_dir=tmp_path, name="killed",
                   worker=["--slow-save", "4:60", "--kill-at", 5], exit_code=1)
    assert f"saved {tmp_path / 'iter_0000002'}" in killed["log"]
    assert f"saved {tmp_path / 'iter_0000004'}" not in killed["log"]
    assert (tmp_path / "latest").read_text().strip() == "iter_0000002"
    assert (tmp_path / "iter_0000004.tmp").is_dir() and not (tmp_path / "iter_0000004").exists()
    resumed = train(1, ASYNC, "train.save_interval=2", save_dir=tmp_path, name="after_kill")
    assert resumed["losses"] == reference["lazy"]["losses"][2:]


def test_a_full_disk_during_a_background_save_stops_with_the_last_one_intact(
        train, reference, tmp_path):
    failed = train(1, ASYNC, "train.save_interval=2", save_dir=tmp_path, name="full_disk",
                   worker=["--full-disk-at", 4], exit_code=1)  # the rank: 2
    assert f"no space left on device while saving {tmp_path / 'iter_0000004'}; " \
           f"{tmp_path / 'iter_0000002'} is intact" in failed["log"]
    assert (tmp_path / "latest").read_text().strip() == "iter_0000002"
    resumed = train(1, ASYNC, "train.save_interval=2", save_dir=tmp_path, name="after_full")
    assert resumed["losses"] == reference["lazy"]["losses"][2:]


def test_a_stop_signal_during_a_save_exits_after_it(train, reference, tmp_path):
    """Two ranks: step 4's save is being written (3 s) when the stop comes after step 5:
    the run commits it, saves step 5, and only then exits for the requeue."""
    stopped = train(2, ASYNC, "train.save_interval=2", save_dir=tmp_path, name="stop_async",
                    preempt_at=5, worker=["--slow-save", "4:3"])
    assert stopped["preempted"] and stopped["step"] == 5
    log = stopped["log"]
    waiting = log.index("step 5 | waiting for the checkpoint of step 4 to be written")
    assert waiting < log.index("saved " + str(tmp_path / "iter_0000004")) < \
        log.index("saved " + str(tmp_path / "iter_0000005"))
    for step in (4, 5):
        checkpoint.verify(tmp_path / checkpoint.iter_name(step))
    assert (tmp_path / "latest").read_text().strip() == "iter_0000005"
    resumed = train(2, ASYNC, "train.save_interval=2", save_dir=tmp_path, name="after_stop")
    assert_same_curve(stopped["losses"] + resumed["losses"], reference["lazy"]["losses"])
