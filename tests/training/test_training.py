"""The trainer end to end in real torchrun/gloo processes on a tiny model and toy data.

Every layout must give the loss curve of the single-rank run (same global batch), and a
killed-then-resumed run must continue it exactly. The tables' placements and schedules,
their sharded state, stages, the guard and a long run's instruments have files of their
own (tests/training/, tests/checkpoint/test_resume.py); the runs they share are the session's (conftest.py:
`train`, `reference`).
"""

import json
import re
import subprocess
import sys
from collections import Counter
from socket import gethostname

import pytest
import torch

from support.processes import ROOT, subprocess_env, tensorboard_steps
from support.training_runs import assert_same_curve
from workers.common import TINY

pytestmark = pytest.mark.integration  # the trainer runs under torchrun


def test_reference_runs_learn(reference):
    for result in reference.values():
        assert result["losses"][-1] < result["losses"][0] - 0.2
        assert result["valid"][-1] < result["valid"][0]
    # The two table semantics really differ.
    assert reference["lazy"]["losses"] != reference["dense"]["losses"]

@pytest.mark.parametrize("update, zero", [("lazy", 1), ("dense", 2)])
def test_data_parallel_2_matches_1(train, reference, update, zero):
    result = train(2, f"optimizer.tables.update={update}", f"optimizer.zero_stage={zero}", name="dp2")
    assert_same_curve(result["losses"], reference[update]["losses"])

def test_tp2_dp2_matches_tp1_dp1(train, reference):
    result = train(4, "parallel.tensor_parallel=2", name="tp2dp2")
    assert_same_curve(result["losses"], reference["lazy"]["losses"])

def test_kill_and_resume_gives_the_same_curve(train, reference, tmp_path, monkeypatch):
    (tmp_path / "job").mkdir()
    marker = tmp_path / "job" / "stopped"
    monkeypatch.setenv("STEM_STOP_MARKER", str(marker))  # as slurm/launch.sh sets it
    first = train(1, save_dir=tmp_path, preempt_at=3, name="preempted")
    assert first["preempted"] and first["step"] == 3
    # The launcher learns that the ranks saved and stopped to be requeued.
    assert list((tmp_path / "job").iterdir()) == [marker.with_name(f"stopped.{gethostname()}")]
    marker.with_name(f"stopped.{gethostname()}").unlink()
    second = train(1, save_dir=tmp_path, name="resumed")
    assert not second["preempted"] and second["step"] == 6
    assert not any((tmp_path / "job").iterdir())
    # Bit-exact: same data position, optimizer states and step count.
    assert first["losses"] + second["losses"] == reference["lazy"]["losses"]
    # One TensorBoard curve: the resumed run keeps the checkpoint step's events.
    assert tensorboard_steps(tmp_path / "tensorboard", "train/loss") == [1, 2, 3, 4, 5, 6]

def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(train, reference,
                                                                    tmp_path):
    """The checkpoint of step 4 lost bytes of a shard after it was committed: the resumed
    run says so in one line, resumes from step 2 and still gives the reference curve."""
    first = train(1, "train.save_interval=2", save_dir=tmp_path, preempt_at=4, name="spoilt")
    shard = tmp_path / "iter_0000004" / "optim" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    second = train(1, "train.save_interval=2", save_dir=tmp_path, name="fallback")
    assert f"warning: refusing checkpoint iter_0000004: {shard}: 1000 bytes" in second["log"]
    assert f"warning: falling back to {tmp_path / 'iter_0000002'}, the newest whole " \
           "checkpoint" in second["log"]
    assert first["step"] == 4 and len(second["losses"]) == 4
    assert second["losses"] == reference["lazy"]["losses"][2:]

def test_stop_signal_during_startup_saves_after_one_step(train, reference, tmp_path):
    """SLURM's stop signal can come while the ranks are still starting: it must not kill
    them by default action; they train one step, save it and stop for the requeue."""
    result = train(1, save_dir=tmp_path, preempt_at=-1, name="startup_stop")
    assert result["preempted"] and result["step"] == 1
    assert result["losses"] == reference["lazy"]["losses"][:1]
    assert (tmp_path / "latest").read_text().strip() == "iter_0000001"

def test_checkpoint_saved_at_tp2_resumes_at_tp1(train, reference, tmp_path):
    first = train(2, "parallel.tensor_parallel=2", save_dir=tmp_path, preempt_at=3, name="tp2")
    second = train(1, save_dir=tmp_path, name="tp1")
    assert_same_curve(first["losses"] + second["losses"], reference["lazy"]["losses"])

# What a step of the 1B recipes' table layout (device/dense/sharded/next_step/cpu) makes
# the host wait for, at DP > 1, by where in the code (docs/training.md, "Host syncs").
STEP_READS = {
    ("tolist", "megatron_stem/runtime/host_read.py:read"): 1,  # the step's values
    ("tolist", "megatron_stem/tables/shards.py:_positions_to_owners"): 2,  # all-to-all sizes
    ("HostStaging.wait", "megatron_stem/tables/optimizer.py:step"): 1,  # grads in CPU memory
    ("Devices.to_host", "megatron_stem/tables/optimizer.py:_next_step_rows"): 1,
    ("tolist", "megatron_stem/tables/optimizer.py:_part_counts"): 1,
}


def test_a_step_reads_the_device_as_often_as_the_docs_say(train):
    """Every read of the device by each rank's main thread (workers/host_reads.py: value
    reads, copies to host memory, the tables' crossings), step by step, with a save
    written in the background through steps 5-7: the same reads in every step but those
    that save, evaluate or end the run, whether a save is in flight or not (its written
    flag is read with the step's other values), as many as docs/training.md says."""
    from workers.host_reads import HOST_SIDE

    result = train(2, "tables.overlap=next_step", "optimizer.tables.update=dense",
                   "train.async_save=true", "train.save_interval=4", "train.steps=8",
                   "train.eval_interval=100", name="host_reads",
                   worker=("--slow-save", "4:3", "--count-host-reads"))
    assert "step 8 | waiting for the checkpoint of step 4" in result["log"]  # in flight
    for rank in (0, 1):
        by_step = json.loads((result["folder"] / f"result.json.reads{rank}").read_text())
        # step k's entry: from step k-1's end (its save, evaluation) to step k's
        for step in (2, 3, 6, 7):  # 6, 7: the save of step 4 in flight
            device = Counter((kind, site) for kind, site in map(tuple, by_step[step - 1])
                             if site not in HOST_SIDE)
            assert device == STEP_READS, (rank, step)
    stated = re.search(r"reads the device (\d+)\s+times", (ROOT / "docs" / "training.md")
                       .read_text())
    assert stated and int(stated[1]) == sum(STEP_READS.values())


def test_cli_reports_missing_data_in_one_line(tmp_path):
    recipe = tmp_path / "r.yaml"
    # its own save_dir: the recipe's (the quickstart's run folder) may hold a finished run
    recipe.write_text("inherit: " + str(ROOT / "recipes" / "tiny_cpu.yaml") +
                      "\ndata: {prefixes: [" + str(tmp_path / "nothing") + "]}\n" +
                      "train: {save_dir: " + str(tmp_path / "ckpt") + "}\n")
    proc = subprocess.run([sys.executable, "-m", "megatron_stem.train", "--recipe", str(recipe)],
                          capture_output=True, text=True, timeout=300, env=subprocess_env())
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == \
        f"error: data.prefixes: {tmp_path / 'nothing'}.bin not found (give the path without " \
        ".bin/.idx, or a prefix-set folder, as written by preprocess_data.py)"
    assert "Traceback" not in proc.stderr

def test_document_masking_trains_through_the_engine(train, reference):
    """The three data fields reach the model through the trainer: the run learns, and its
    curve is not the unmasked one (the toy documents are 21-81 tokens, rows 32)."""
    result = train(1, "data.reset_position_ids=true", "data.reset_attention_mask=true",
                   "data.eod_mask_loss=true", name="documents")
    assert result["losses"][-1] < result["losses"][0] - 0.2
    assert result["losses"][0] != pytest.approx(reference["lazy"]["losses"][0], rel=1e-4)

def test_the_loss_in_chunks_and_selective_recompute_train_the_reference_curve(train,
                                                                               reference):
    """The 32k stage's memory settings (docs/training.md) through the DeepSpeed engine."""
    result = train(1, "parallel.loss_chunk_tokens=20", "parallel.recompute=selective",
                   "parallel.recompute_modules=[core_attn,mlp_act]", name="memory")
    assert_same_curve(result["losses"], reference["lazy"]["losses"])


def test_resuming_a_weights_only_checkpoint_is_a_clear_error(world1, tmp_path):
    from megatron_stem import checkpoint
    from megatron_stem.config import ParallelConfig, Recipe, TrainConfig
    from megatron_stem.runtime.errors import UserError
    from megatron_stem.model import build_model
    from megatron_stem.checkpoint.checkpointer import Checkpointer
    from workers.common import tiny_model

    recipe = Recipe(model=tiny_model(), train=TrainConfig(save_dir=str(tmp_path)))
    with checkpoint.Writer(tmp_path, 0, recipe) as folder:
        checkpoint.save_model(build_model(recipe.model, ParallelConfig()), folder)
    with pytest.raises(UserError, match="holds model weights only .* train.init_from="):
        Checkpointer(recipe)

def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(sp_model):
    from megatron_stem.training import checks as trainer_checks
    from megatron_stem.config import Recipe, from_dict
    from megatron_stem.runtime.errors import UserError

    recipe = from_dict(Recipe, {"model": {**TINY, "vocab_size": 999},
                                "data": {"tokenizer_type": "sentencepiece",
                                         "tokenizer_model": sp_model}})
    with pytest.raises(UserError, match=r"^data\.tokenizer_model: .*gcide\.model: the tokenizer "
                                        r"has 1000 tokens but the model's vocab_size is 999"):
        trainer_checks.load_tokenizer(recipe)
    recipe.model.vocab_size = 1000
    assert trainer_checks.load_tokenizer(recipe).vocab_size == 1000

@pytest.mark.parametrize("variable, value", [("SLURM_GPUS_ON_NODE", "8"),
                                             ("SLURM_JOB_GPUS", "0,1"),
                                             ("CUDA_VISIBLE_DEVICES", "0")])
def test_gpus_given_but_unseen_by_torch_is_one_error_line(monkeypatch, variable, value):
    """A CPU-only torch wheel on a GPU node would train on gloo without a word."""
    from megatron_stem.training import checks as trainer_checks
    from megatron_stem.runtime.errors import UserError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(UserError, match=rf"^{variable}={value}: this job has GPUs but torch "
                                        r"\S+ is a CPU-only build and sees none; install "
                                        r"torch's CUDA build .*STEM_ALLOW_CPU=1"):
        trainer_checks.check_gpus_visible({variable: value})
    monkeypatch.setattr(torch.version, "cuda", "12.6")
    with pytest.raises(UserError, match=r"\(CUDA 12\.6\) sees none: the GPU driver is missing"):
        trainer_checks.check_gpus_visible({variable: value})
    # No GPUs given: a CPU run is what was asked for.
    for environ in ({}, {"SLURM_GPUS_ON_NODE": "0"}, {"CUDA_VISIBLE_DEVICES": ""},
                    {"CUDA_VISIBLE_DEVICES": "NoDevFiles"},
                    {variable: value, "STEM_ALLOW_CPU": "1"}):  # CPU on purpose
        trainer_checks.check_gpus_visible(environ)
