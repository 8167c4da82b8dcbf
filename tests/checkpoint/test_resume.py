"""Training state across a stop and a resume (torchrun/gloo, tiny model): bit-exact at DP2
with each table kernel, the tables' state sharded over four ranks or resumed sharded from
a replicated checkpoint, and the peak memory of saving and resuming.

The train state (`train_state.pt`: step, data position, RNG state) is read without
unpickling objects (`torch.load(weights_only=True)`): a checkpoint folder from a shared
filesystem or a download could otherwise run code at resume."""

import json
import pathlib
import shutil

import pytest
import torch

from megatron_stem.checkpoint.train_state import TRAIN_STATE, load_train_state, save_train_state
from megatron_stem.runtime.errors import UserError
from support.processes import ROOT
from support.training_runs import (
    assert_same_checkpoints,
    assert_same_curve,
    tensor_digests,
    tensorboard_scalars,
)
from workers.common import TINY


# Each kernel and update mode once; DeepSpeed's kernel with the dense parameters offloaded.
@pytest.mark.parametrize("kernel, update, offload", [
    ("torch", "lazy", False), ("deepspeed", "dense", True)])
@pytest.mark.integration  # the trainer runs under torchrun
def test_dp2_killed_and_resumed_is_bit_exact(train, tmp_path, kernel, update, offload):
    """Both table kernels (DeepSpeed's CPU Adam keeps running beta powers that a resumed
    kernel must get back), both update semantics, and DeepSpeed's own CPU Adam for the
    dense parameters (ZeRO-Offload): a DP2 run killed at step 5 and resumed continues the
    uninterrupted run bit for bit. (Step 6, the first one resumed, is one where the float32
    running product 0.95^6 differs from pow(0.95, 6).)"""
    options = [f"optimizer.tables.kernel={kernel}", f"optimizer.tables.update={update}",
               f"optimizer.offload={offload}", "train.steps=8"]
    straight = train(2, *options, name="dp2_straight")
    first = train(2, *options, save_dir=tmp_path, preempt_at=5, name="dp2_preempted")
    second = train(2, *options, save_dir=tmp_path, name="dp2_resumed")
    assert first["step"] == 5 and second["step"] == 8
    assert first["losses"] + second["losses"] == straight["losses"]
    assert_same_checkpoints(tmp_path / "iter_0000008", straight["save_dir"] / "iter_0000008")
    # Both ranks wrote their share of each part (megatron's fully parallel save).
    for part in ("model", "optim"):
        written = {}
        for shard in (tmp_path / "iter_0000005" / part).glob("__*.distcp"):
            rank = shard.name.split("_")[2]
            written[rank] = written.get(rank, 0) + shard.stat().st_size
        assert written.keys() == {"0", "1"} and min(written.values()) > 0.3 * max(written.values())

@pytest.mark.parametrize("placement, update, extra", [
    ("device", "dense", []),
    ("host", "lazy", ["tables.ranks_per_copy=2"]),  # two copies of two ranks: cross-copy rows
])
@pytest.mark.integration  # the trainer runs under torchrun
def test_sharded_state_at_dp4_across_a_resume_matches_the_replicated_reference(
        train, tmp_path, placement, update, extra):
    """The table state sharded over four ranks, stopped at step 6 and resumed, gives the
    12-step loss curve of one rank keeping the whole state (the replicated path, itself
    tested against torch's AdamW and a row-wise Adam) to 1e-6; each rank holds and updates
    a quarter of it (the trainer's `tables/*` counters)."""
    options = [f"optimizer.tables.update={update}", "train.steps=12", "train.eval_interval=12"]
    reference = train(1, *options, "tables.partition=replicated", name="replicated12")
    sharded = [f"tables.placement={placement}", "tables.partition=sharded", *extra, *options]
    first = train(4, *sharded, save_dir=tmp_path, preempt_at=6, name="sharded_first")
    second = train(4, *sharded, save_dir=tmp_path, name="sharded_resumed")
    assert first["step"] == 6 and second["step"] == 12
    assert_same_curve(first["losses"] + second["losses"], reference["losses"], rel=1e-6)
    elements = 2 * TINY["vocab_size"] * TINY["ffn_hidden_size"]  # two tables
    log = tensorboard_scalars(tmp_path / "tensorboard")
    # Two fp32 moments (the fp32 CPU table is its own master).
    assert set(log["tables/cpu_state_bytes"].values()) == {2 * 4 * elements / 4}
    adam = list(log["tables/adam_elements"].values())
    assert len(adam) == 12
    if update == "dense":
        assert set(adam) == {elements / 4}
    else:  # the shard's rows touched by any rank
        assert 0 < min(adam) and max(adam) < elements / 4

@pytest.mark.integration  # the trainer runs under torchrun
def test_a_replicated_checkpoint_resumes_sharded_on_two_ranks(train, tmp_path):
    """Checkpoints keep the table states in one row order (the shards' interleaved order)
    whatever the partition and the data-parallel size: a run saved with the whole state on
    one rank resumes with it sharded over two, on the uninterrupted curve."""
    options = ["optimizer.tables.update=lazy", "train.steps=12", "train.eval_interval=12"]
    reference = train(1, *options, "tables.partition=replicated", name="whole12")  # shared
    first = train(1, *options, "tables.partition=replicated", save_dir=tmp_path,
                  preempt_at=6, name="whole_first")
    second = train(2, *options, "tables.partition=sharded", save_dir=tmp_path,
                   name="sharded_resumed")
    assert first["step"] == 6 and second["step"] == 12
    assert_same_curve(first["losses"] + second["losses"], reference["losses"], rel=1e-6)

BEFORE_PARTITIONS = ROOT / "tests" / "fixtures" / "checkpoint_before_partitions"


@pytest.mark.integration  # the trainer runs under torchrun
def test_a_checkpoint_saved_before_partitioned_states_resumes_bit_exactly(train, tmp_path):
    """A checkpoint of the code that saved each dense optimizer state whole (DP2, step 2 of
    4; tests/fixtures/make_checkpoint_fixture.py), resumed by this code at DP2: steps 3
    and 4 give that code's uninterrupted losses, and the final checkpoint every one of its
    tensors, bit for bit."""
    expected = json.loads((BEFORE_PARTITIONS / "expected.json").read_text())
    shutil.copytree(BEFORE_PARTITIONS / "iter_0000002", tmp_path / "iter_0000002")
    shutil.copy(BEFORE_PARTITIONS / "latest", tmp_path)
    resumed = train(2, *expected["overrides"], save_dir=tmp_path, name="before_partitions")
    assert resumed["losses"] == expected["losses"]
    assert tensor_digests(tmp_path / "iter_0000004") == expected["tensors"]

# Peak memory of saving and resuming when the tables' optimizer state dominates: resuming
# loads each rank's share of the table state straight into the live tensors (no
# placeholders beside them), so a resumed run peaks where a fresh one does; a save writes
# from the live tensors too.

# Two STEM tables of 16,384 x 1,536 fp32 (100 MB each): with the state sharded over two
# ranks, 200 MB of Adam moments per rank next to 200 MB of tables.
BIG_TABLES = ["model.vocab_size=16384", "model.ffn_hidden_size=1536", "optimizer.tables.update=dense"]

def _peaks(folder, ranks=2) -> list[list[int]]:
    return [json.loads((folder / f"result.json.rss{r}").read_text()) for r in range(ranks)]

@pytest.mark.integration  # the trainer runs under torchrun
@pytest.mark.parametrize("placement", ["device", "host"])
def test_resume_and_save_peak_memory_stay_within_15_percent(train, tmp_path, placement):
    ckpt = tmp_path / "ckpt"
    options = [*BIG_TABLES, f"tables.placement={placement}", "train.save_interval=2"]
    first = train(2, *options, "train.steps=2", save_dir=ckpt, name="fresh", rss=True)
    resumed = train(2, *options, "train.steps=3", save_dir=ckpt, name="resumed", rss=True)
    assert first["step"] == 2 and resumed["step"] == 3
    for fresh, again in zip(_peaks(first["folder"]), _peaks(resumed["folder"])):
        steady = fresh[0]  # after the first step: every state allocated, nothing saved
        assert steady > 400e6  # the tables and their state really are what this measures
        assert fresh[-1] / steady <= 1.15, "saving"
        assert again[0] / steady <= 1.15, "resuming"


def test_a_train_state_written_by_earlier_versions_still_loads(tmp_path):
    # What every earlier version wrote (checkpoint/checkpointer.py's call, train_state.py's torch.save).
    rng = torch.get_rng_state()
    torch.save({"step": 12, "rng_cpu": rng, "consumed_samples": 96}, tmp_path / TRAIN_STATE)
    state = load_train_state(tmp_path)
    assert state.keys() == {"step", "rng_cpu", "consumed_samples"}
    assert (state["step"], state["consumed_samples"]) == (12, 96)
    assert torch.equal(state["rng_cpu"], rng)


def test_the_train_state_round_trips_and_holds_numbers_and_tensors_only(tmp_path):
    save_train_state(tmp_path, 7, {"consumed_samples": 56})
    state = load_train_state(tmp_path)
    assert (state["step"], state["consumed_samples"]) == (7, 56)
    assert torch.equal(state["rng_cpu"], torch.get_rng_state())
    with pytest.raises(TypeError, match=r"numbers and tensors only, got \{'data': 'dict'\}"):
        save_train_state(tmp_path, 7, {"data": {"epoch": 1}})


class _Touch:
    """A pickled object that, when loaded, creates a file: what an attacker's would do."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return pathlib.Path.touch, (self.path,)


def test_a_train_state_holding_an_object_is_refused_without_running_it(tmp_path):
    ran = tmp_path / "ran"
    torch.save({"step": 3, "rng_cpu": torch.get_rng_state(), "x": _Touch(ran)},
               tmp_path / TRAIN_STATE)
    with pytest.raises(UserError) as refused:
        load_train_state(tmp_path)
    assert str(refused.value) == (
        f"{tmp_path / TRAIN_STATE}: refused: it holds a Python object (getattr), not only "
        "the numbers and tensors of a train state, and loading it could run code (this "
        "project never writes one: the file was made or altered elsewhere)")
    assert not ran.exists()
