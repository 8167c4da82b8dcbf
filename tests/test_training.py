"""The trainer end to end in real torchrun/gloo processes on a tiny model and toy data.

Every layout and update semantics must give the loss curve of the single-rank run
(same global batch), and a killed-then-resumed run must continue it exactly.
"""

import json
import re
import shutil
import subprocess
import sys
from socket import gethostname

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from conftest import (ROOT, lm_eval_offline_env, run_lm_eval_cli, subprocess_env,
                      tensorboard_steps, tool, torchrun, write_local_lm_eval_tasks)
from workers.common import TINY

pytestmark = pytest.mark.integration  # the trainer runs under torchrun


def write_documents(prefix: str, seed: int, document, count: int = 400) -> str:
    """`count` documents `document(rng)` (ids below 290), each ended by eod = 299, as the
    `.bin/.idx` pair `prefix`."""
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(count):
        doc = np.append(document(rng), 299)
        builder.add_document(torch.tensor(doc), [len(doc)])
    builder.finalize(prefix + ".idx")
    return prefix


def progressions(strides=(1, 4), lengths=(20, 80)):
    """Arithmetic-progression documents, strides and lengths drawn from [a, b)."""
    def draw(rng):
        start, stride, length = rng.integers(0, 290), rng.integers(*strides), \
            rng.integers(*lengths)
        return (start + stride * np.arange(length)) % 290
    return draw


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory):
    """400 arithmetic-progression documents over a 300-token vocabulary (eod = 299)."""
    return write_documents(str(tmp_path_factory.mktemp("data") / "toy"), 0, progressions())


@pytest.fixture(scope="module")
def train(toy_data, tmp_path_factory):
    """`train(nproc, *overrides, ...)`: a run's result, its log and folders. A plain run
    (its own folder, nothing planted or stopped) is run once per module and shared by the
    tests that ask for the same one: its folders are read-only to them."""
    done = {}

    def shared(nproc, *overrides, name="run", **options):
        if options:
            return run(nproc, *overrides, name=name, **options)
        key = (nproc, overrides)
        if key not in done:
            done[key] = run(nproc, *overrides, name=name)
        return done[key]

    def run(nproc, *overrides, name="run", save_dir=None, preempt_at=0, rss=False,
            delay_rest=0.0, plant_nan=0, exit_code=0):
        folder = tmp_path_factory.mktemp(name)
        out = folder / "result.json"
        options = ["--data", toy_data, "--out", out, "--preempt-at", preempt_at,
                   "--delay-rest", delay_rest, "--plant-nan", plant_nan,
                   *(["--rss"] if rss else [])]
        save_dir = save_dir or folder / "ckpt"
        log = torchrun(nproc, "train_worker.py", *options, f"train.save_dir={save_dir}",
                       *overrides, exit_code=exit_code)
        result = json.loads(out.read_text()) if out.is_file() else {}
        return {**result, "folder": folder, "save_dir": save_dir, "log": log}
    return shared


@pytest.fixture(scope="module")
def reference(train):
    return {update: train(1, f"optimizer.tables.update={update}", name=f"ref_{update}")
            for update in ("lazy", "dense")}


def assert_same_curve(losses, expected, rel=1e-5):
    assert len(losses) == len(expected)
    assert losses == pytest.approx(expected, rel=rel)


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


# Each kernel and update mode once; DeepSpeed's kernel with the dense parameters offloaded.
@pytest.mark.parametrize("kernel, update, offload", [
    ("torch", "lazy", False), ("deepspeed", "dense", True)])
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


# Each kernel, each update mode and each partition once (the suite's time: the full
# 2 x 2 x 2 adds four minutes and no path).
@pytest.mark.parametrize("kernel, update, partition", [
    ("torch", "lazy", "sharded"), ("deepspeed", "dense", "replicated")])
def test_host_tables_match_device_tables_bit_for_bit(train, kernel, update, partition):
    """Both placements sum a row's gradients the same way (training/row_grads.py), compute
    the same grad norm and run the same update: the same losses and checkpoints, bit for
    bit, at DP2 (two micro-batches per rank, one host copy shared by both ranks)."""
    options = [f"optimizer.tables.kernel={kernel}", f"optimizer.tables.update={update}",
               f"tables.partition={partition}", "train.steps=8"]
    device = train(2, *options, name="placement_device")
    host = train(2, *options, "tables.placement=host", name="placement_host")
    assert host["losses"] == device["losses"]
    assert_same_checkpoints(host["save_dir"] / "iter_0000008",
                            device["save_dir"] / "iter_0000008")


def assert_same_checkpoints(ours, theirs):
    """Every weight and optimizer state of two checkpoints, bit for bit (an ulp shows here
    long before it reaches the loss)."""
    for part in ("model", "optim"):
        mine, other = saved_tensors(ours / part), saved_tensors(theirs / part)
        assert mine.keys() == other.keys()
        assert [k for k in mine if not torch.equal(mine[k], other[k])] == []


def saved_tensors(folder) -> dict[str, torch.Tensor]:
    """The tensors of a megatron dist checkpoint (torch_dist format), read whole."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder, folder.parent / f"{folder.name}.pt")
    state = torch.load(folder.parent / f"{folder.name}.pt", weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


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


def test_host_tables_two_ranks_one_copy_killed_and_resumed(host_run, reference):
    """tables.placement=host: 2 DP ranks share one host copy (each updates the rows it
    owns), with a hot-row cache and activation recompute; killed at step 3 and resumed,
    the curve is the device-resident single-rank one, with every instrument of a long run
    on (below: they change nothing). The host metrics are logged."""
    first, second, save_dir = (host_run[k] for k in ("first", "second", "save_dir"))
    assert first["step"] == 3 and second["step"] == 6
    assert_same_curve(first["losses"] + second["losses"], reference["lazy"]["losses"])
    log = tensorboard_scalars(save_dir / "tensorboard")
    for tag in ("tables/prefetch_wait_ms", "tables/h2d_bytes", "tables/cache_hit_rate"):
        assert sorted(log[tag]) == list(range(1, 7)), tag
    assert all(v > 0 for v in log["tables/h2d_bytes"].values())
    # Each run starts with an empty cache, then hot rows hit.
    assert log["tables/cache_hit_rate"][1] == log["tables/cache_hit_rate"][4] == 0
    assert all(0 < log["tables/cache_hit_rate"][s] < 1 for s in (2, 3, 5, 6))


def tensorboard_scalars(folder) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} over every event file in `folder` (a resumed run adds one)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    out = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                out.setdefault(value.tag, {})[event.step] = value.tensor.float_val[0]
    return out


def test_host_tables_dense_update_matches_device(train, reference):
    result = train(1, "optimizer.tables.update=dense", "tables.placement=host", "tables.cache_rows=32",
                   "optimizer.zero_stage=2", name="host_dense")
    assert_same_curve(result["losses"], reference["dense"]["losses"])


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
        ".bin/.idx, as written by preprocess_data.py)"
    assert "Traceback" not in proc.stderr


# --- stages: a run initialized from another run's checkpoint ---------------------------

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


def test_document_masking_trains_through_the_engine(train, reference):
    """The three data fields reach the model through the trainer: the run learns, and its
    curve is not the unmasked one (the toy documents are 21-81 tokens, rows 32)."""
    result = train(1, "data.reset_position_ids=true", "data.reset_attention_mask=true",
                   "data.eod_mask_loss=true", name="documents")
    assert result["losses"][-1] < result["losses"][0] - 0.2
    assert result["losses"][0] != pytest.approx(reference["lazy"]["losses"][0], rel=1e-4)


def test_resuming_a_weights_only_checkpoint_is_a_clear_error(world1, tmp_path):
    from megatron_stem import checkpoint
    from megatron_stem.config import ParallelConfig, Recipe, TrainConfig
    from megatron_stem.errors import UserError
    from megatron_stem.model import build_model
    from megatron_stem.training.checkpointing import Checkpointer
    from workers.common import tiny_model

    recipe = Recipe(model=tiny_model(), train=TrainConfig(save_dir=str(tmp_path)))
    with checkpoint.Writer(tmp_path, 0, recipe) as folder:
        checkpoint.save_model(build_model(recipe.model, ParallelConfig()), folder)
    with pytest.raises(UserError, match="holds model weights only .* train.init_from="):
        Checkpointer(recipe)


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(sp_model):
    from megatron_stem import train as trainer
    from megatron_stem.config import Recipe, from_dict
    from megatron_stem.errors import UserError

    recipe = from_dict(Recipe, {"model": {**TINY, "vocab_size": 999},
                                "data": {"tokenizer_type": "sentencepiece",
                                         "tokenizer_model": sp_model}})
    with pytest.raises(UserError, match=r"^data\.tokenizer_model: .*gcide\.model: the tokenizer "
                                        r"has 1000 tokens but the model's vocab_size is 999"):
        trainer._load_tokenizer(recipe)
    recipe.model.vocab_size = 1000
    assert trainer._load_tokenizer(recipe).vocab_size == 1000


@pytest.mark.parametrize("placement, update, extra", [
    ("device", "dense", []),
    ("host", "lazy", ["tables.ranks_per_copy=2"]),  # two copies of two ranks: cross-copy rows
])
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


@pytest.mark.parametrize("update, zero", [("lazy", 1), ("dense", 2)])
def test_update_overlapped_with_the_next_step_gives_the_same_curve(train, update, zero):
    """`tables.overlap: next_step` updates the rows the next step's first micro-batch
    reads first, then its later micro-batches', and the rest while it runs: the same
    arithmetic, so the loss curve of the serial update, bit for bit, with the state
    sharded over two ranks (two micro-batches each). All but the first micro-batch's rows
    are held back until its forward has surely run, so a row a lookup needed but did not
    wait for would show."""
    options = [f"optimizer.tables.update={update}", f"optimizer.zero_stage={zero}"]
    serial = train(2, *options, name="dp2")  # test_data_parallel_2_matches_1's run
    overlapped = train(2, *options, "tables.overlap=next_step", name="overlapped",
                       delay_rest=0.3)
    assert overlapped["losses"] == serial["losses"]
    assert overlapped["valid"] == serial["valid"]


# --- peak memory of saving and resuming when the tables' optimizer state dominates ---
# Resuming loads each rank's share of the table state straight into the live tensors (no
# placeholders beside them), so a resumed run peaks where a fresh one does; a save writes
# from the live tensors too.

# Two STEM tables of 16,384 x 1,536 fp32 (100 MB each): with the state sharded over two
# ranks, 200 MB of Adam moments per rank next to 200 MB of tables.
BIG_TABLES = ["model.vocab_size=16384", "model.ffn_hidden_size=1536", "optimizer.tables.update=dense"]


def _peaks(folder, ranks=2) -> list[list[int]]:
    return [json.loads((folder / f"result.json.rss{r}").read_text()) for r in range(ranks)]


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


# The 1B recipe's table path: bf16 tables (so the fp32 master is a copy of its own), the
# state sharded, the update overlapped with the next step or not, the state in CPU or
# accelerator memory, each against the replicated path at the same data-parallel size.
BF16 = ["train.dtype=bf16", "optimizer.tables.update=dense", "train.steps=8",
        "train.eval_interval=8"]


@pytest.fixture(scope="module")
def bf16_replicated(train):
    return {dp: train(dp, *BF16, "tables.partition=replicated", name=f"bf16_replicated{dp}")
            for dp in (2,)}


# The recipe's overlap with each place of the state (DP4 sharding and `overlap: none` are
# the fp32 tests' too: the suite's time).
@pytest.mark.parametrize("dp, overlap, state", [
    (2, "next_step", "cpu"), (2, "next_step", "accelerator")])
def test_the_1b_table_path_in_bf16_follows_the_replicated_reference(
        train, bf16_replicated, dp, overlap, state):
    result = train(dp, *BF16, "tables.partition=sharded", f"tables.overlap={overlap}",
                   f"optimizer.tables.device={state}", name=f"bf16_{dp}_{overlap}_{state}")
    reference = bf16_replicated[dp]
    assert result["losses"][-1] < result["losses"][0]  # it trains
    assert_same_curve(result["losses"], reference["losses"], rel=2e-3)
    log = tensorboard_scalars(result["save_dir"] / "tensorboard")
    # The state really is where the recipe says (on a CPU run both are the CPU's memory:
    # the layout, not the device, decides where the optimizer allocates and copies).
    other = {"cpu": "accelerator", "accelerator": "cpu"}[state]
    assert f"tables/{state}_state_bytes" in log and f"tables/{other}_state_bytes" not in log


@pytest.mark.parametrize("variable, value", [("SLURM_GPUS_ON_NODE", "8"),
                                             ("SLURM_JOB_GPUS", "0,1"),
                                             ("CUDA_VISIBLE_DEVICES", "0")])
def test_gpus_given_but_unseen_by_torch_is_one_error_line(monkeypatch, variable, value):
    """A CPU-only torch wheel on a GPU node would train on gloo without a word."""
    from megatron_stem import train as trainer
    from megatron_stem.errors import UserError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(UserError, match=rf"^{variable}={value}: this job has GPUs but torch "
                                        r"\S+ is a CPU-only build and sees none; install "
                                        r"torch's CUDA build .*STEM_ALLOW_CPU=1"):
        trainer.check_gpus_visible({variable: value})
    monkeypatch.setattr(torch.version, "cuda", "12.6")
    with pytest.raises(UserError, match=r"\(CUDA 12\.6\) sees none: the GPU driver is missing"):
        trainer.check_gpus_visible({variable: value})
    # No GPUs given: a CPU run is what was asked for.
    for environ in ({}, {"SLURM_GPUS_ON_NODE": "0"}, {"CUDA_VISIBLE_DEVICES": ""},
                    {"CUDA_VISIBLE_DEVICES": "NoDevFiles"},
                    {variable: value, "STEM_ALLOW_CPU": "1"}):  # CPU on purpose
        trainer.check_gpus_visible(environ)


# --- the divergence guard (training/guard.py, training/update.py) ---


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
    from megatron_stem.training.state import load_train_state

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


# --- a long run's instruments, carried by the host-table run killed and resumed above:
# W&B (offline), a profiler window, named validation sets, lm-eval in the loop ---


@pytest.fixture(scope="module")
def held_out(tmp_path_factory):
    """40 documents of stride 5 (the training data's are 1-3): a validation set apart."""
    return write_documents(str(tmp_path_factory.mktemp("held_out") / "held_out"), 1,
                           progressions(strides=(5, 6), lengths=(30, 60)), count=40)


@pytest.fixture(scope="module")
def text_tokenizer(tmp_path_factory, corpus_texts) -> str:
    """A 256-piece SentencePiece model (the tiny model's vocabulary is 300) for lm-eval's
    text. No pad id: megatron's dataset masks the labels equal to a tokenizer's pad id,
    which would change the toy data's samples."""
    import sentencepiece

    prefix = tmp_path_factory.mktemp("text_tokenizer") / "sp256"
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus_texts[:1000]), model_prefix=str(prefix), vocab_size=256,
        hard_vocab_limit=False, minloglevel=2)
    return str(prefix.with_suffix(".model"))


@pytest.fixture(scope="module")
def host_run(train, held_out, text_tokenizer, tmp_path_factory):
    """2 ranks sharing one host copy of the tables (a hot-row cache, recompute), stopped
    after step 3 and resumed to step 6, carrying every instrument of a long run: W&B
    (offline), a profiler window over steps 2-3 on rank 1, the split's validation and a
    named set, two local lm-eval tasks every 3 steps (a real tokenizer)."""
    root = tmp_path_factory.mktemp("host_run")
    tasks = write_local_lm_eval_tasks(root / "tasks")
    options = ["tables.placement=host", "tables.cache_rows=64", "parallel.recompute=full",
               f"data.tokenizer_model={text_tokenizer}",
               f"data.validation={{held_out: {held_out}}}", "metrics.wandb_project=stem-tests",
               "profile.start_step=2", "profile.steps=2", "profile.ranks=[1]",
               "lm_eval.interval=3", "lm_eval.tasks=[my_local_task, my_local_perplexity]",
               f"lm_eval.include_path={tasks}", "lm_eval.batch_size=4"]
    save_dir = root / "ckpt"
    with pytest.MonkeyPatch.context() as env:
        for name, value in lm_eval_offline_env(root).items():
            env.setenv(name, value)
        env.setenv("WANDB_MODE", "offline")
        first = train(2, *options, save_dir=save_dir, preempt_at=3, name="host_lazy")
        second = train(2, *options, save_dir=save_dir, name="host_lazy_resumed")
    return {"first": first, "second": second, "save_dir": save_dir, "tasks": tasks,
            "root": root, "tokenizer": text_tokenizer}


def wandb_history(save_dir) -> tuple[set[str], dict[str, dict[int, float]], list[dict]]:
    """(run ids, {key: {step: value}}, run configs) of every offline W&B run folder."""
    from wandb_records import read_run

    ids, history, configs = set(), {}, []
    for folder in sorted((save_dir / "wandb").glob("offline-run-*")):
        run_id, rows, config = read_run(folder)
        ids.add(run_id)
        configs.append(config)
        for step, row in rows:
            for key, value in row.items():
                history.setdefault(key, {})[step] = value
    return ids, history, configs


def test_wandb_offline_holds_every_logged_step_across_a_resume(host_run):
    first, second, save_dir = (host_run[k] for k in ("first", "second", "save_dir"))
    assert first["step"] == 3 and second["step"] == 6
    ids, history, configs = wandb_history(save_dir)
    assert ids == {(save_dir / "wandb_run_id").read_text().strip()}  # one W&B run
    assert len(configs) == 2  # one offline folder per job
    losses = first["losses"] + second["losses"]
    assert history["train/loss"] == {s: pytest.approx(v, rel=1e-12)
                                     for s, v in enumerate(losses, start=1)}
    assert sorted(history["valid/held_out/loss"]) == sorted(history["valid/loss"]) == [3, 6]
    assert sorted(history["lm_eval/my_local_task/acc"]) == [3, 6]
    assert sorted(history["time/tables_exposed_ms"]) == list(range(1, 7))
    assert configs[-1]["optimizer"]["lr"] == 3e-3 and configs[-1]["lm_eval"]["interval"] == 3


def test_named_validation_sets_are_logged_under_their_names(host_run):
    first, second, save_dir = (host_run[k] for k in ("first", "second", "save_dir"))
    log = tensorboard_scalars(save_dir / "tensorboard")
    assert sorted(log["valid/loss"]) == sorted(log["valid/held_out/loss"]) == [3, 6]
    assert [log["valid/held_out/loss"][s] for s in (3, 6)] == pytest.approx(
        first["valid_sets"]["held_out"] + second["valid_sets"]["held_out"], rel=1e-6)
    assert [log["valid/loss"][s] for s in (3, 6)] == pytest.approx(
        first["valid"] + second["valid"], rel=1e-6)  # TensorBoard keeps float32
    assert log["valid/held_out/loss"][3] != log["valid/loss"][3]  # another set's loss
    assert "step 6 | valid held_out loss " in second["log"]


def test_a_profiler_window_writes_a_trace_that_loads_on_its_rank_only(host_run):
    folder = host_run["save_dir"] / "profile"
    (trace,) = folder.glob("*.pt.trace.json")  # rank 1's; rank 0 traces nothing
    assert trace.name.startswith("rank1.")
    names = [e.get("name", "") for e in json.loads(trace.read_text())["traceEvents"]]
    assert len({n for n in names if n.startswith("ProfilerStep#")}) == 2
    for phase, each_step in [("forward_backward", 2), ("backbone_step", 1),
                             ("tables_sync", 1), ("tables_step", 1)]:
        assert names.count(phase) == 2 * each_step, phase  # 2 micro-batches a step
    line = next(line for line in host_run["first"]["log"].splitlines()
                if line.startswith("step 3/6 |"))
    assert re.search(r"\| step [\d.,]+ ms \(fwd/bwd [\d.,]+, backbone [\d.,]+, tables "
                     r"[\d.,]+, exposed tables [\d.,]+\) \| [\d,]+ tok/s \([\d,]+/rank\) \|", line)


def test_in_loop_lm_eval_scores_equal_the_export_evaluated_by_lm_eval(host_run):
    """The scores of step 6, computed in the loop (DP2, host-resident tables, no export),
    are those of `tools/to_hf.py` + `lm_eval --model hf` on the step-6 checkpoint."""
    root, save_dir = host_run["root"], host_run["save_dir"]
    in_loop = host_run["second"]["downstream"][-1]
    assert in_loop["step"] == 6 and [r["step"] for r in host_run["first"]["downstream"]] == [3]
    export = root / "hf"
    assert tool("to_hf")(["--checkpoint", str(save_dir / "iter_0000006"), "--output",
                          str(export), "--tokenizer", host_run["tokenizer"]]) == 0
    results = run_lm_eval_cli(export, host_run["tasks"],
                              ["my_local_task", "my_local_perplexity"], root)
    for task in ("my_local_task", "my_local_perplexity"):
        exported = {k.split(",")[0]: v for k, v in results["results"][task].items()
                    if k.endswith(",none") and "_stderr" not in k}
        assert exported.keys() == in_loop["scores"][task].keys()
        assert in_loop["scores"][task] == pytest.approx(exported, rel=1e-5), task
    assert 0 < in_loop["scores"]["my_local_task"]["acc"] < 1  # a comparison of substance
