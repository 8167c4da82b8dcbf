"""The paper's training pipeline as recipes: token budgets, the chain of stages, data
recipes, what a stage may change of the model it starts from, and the memory plan.

A run started from another run's weights (`train.init_from`): its STEM tables kept or
re-initialized (`train.init_tables`), and a STEM model started from its dense baseline,
whose STEM layers drop the dense up-projections and start fresh tables (what the
official code's `init_ckpt_path` amounts to).

Stages: a run initialized from another run's checkpoint (torchrun/gloo, tiny model),
with or without its optimizer states, at another layout or sequence length."""

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_stem import checkpoint
from megatron_stem.checkpoint.checkpointer import Checkpointer
from megatron_stem.config import ModelConfig, ParallelConfig, Recipe, TrainConfig, load_recipe
from megatron_stem.model import build_model
from megatron_stem.runtime.errors import ConfigError, UserError
from support.processes import ROOT, merge_rank_dumps, tensorboard_steps, tool_main, torchrun
from support.training_runs import assert_same_curve, write_documents
from workers.common import TINY, tiny_model

# The paper's budgets: tokens per stage, and the stages in order (each starts from the
# last checkpoint of the one before).
PIPELINES = {
    "1b": [("stem_1b_pretrain", 1e12), ("stem_1b_midtrain", 100e9), ("stem_1b_long", 20e9)],
    "1b dense": [("dense_1b_pretrain", 1e12), ("dense_1b_midtrain", 100e9),
                 ("dense_1b_long", 20e9)],
    "350m": [("dense_350m", 100e9)],
    **{f"350m {p}": [(f"stem_350m_{p}", 100e9)] for p in ("third", "half", "full")},
}
STAGES = [stage for chain in PIPELINES.values() for stage in chain]


def recipe(name: str) -> Recipe:
    return load_recipe(ROOT / "recipes" / f"{name}.yaml")


@pytest.mark.parametrize("name, budget", STAGES, ids=[n for n, _ in STAGES])
def test_steps_x_batch_x_sequence_is_the_papers_budget_within_2_percent(name, budget):
    r = recipe(name)
    tokens = r.train.steps * r.train.global_batch_size * r.model.seq_length
    assert abs(tokens / budget - 1) <= 0.02, f"{name}: {tokens:,} tokens for {budget:,.0f}"


def test_the_long_context_stage_is_the_papers():
    r = recipe("stem_1b_long")
    assert r.model.seq_length == 32768
    assert r.data.reset_attention_mask and r.data.reset_position_ids  # cross-document masking
    assert r.data.sources[0].dataset == "princeton-nlp/prolong-data-64K"
    mid = recipe("stem_1b_midtrain").data.sources
    assert [(s.dataset.split()[0], s.weight) for s in mid] == [
        ("allenai/olmo-mix-1124", 0.65), ("nvidia/Nemotron-CC-Math-v1", 0.05),
        ("nvidia/Nemotron-Pretraining-Code-v1", 0.30)]


def sbatch_of(name: str) -> tuple[str, str]:
    """(job name, default recipe) of the sbatch file that launches recipe `name`."""
    for script in (ROOT / "slurm").glob("*.sbatch"):
        text = script.read_text()
        if f"STEM_RECIPE:-recipes/{name}.yaml}}" in text:
            return re.search(r"#SBATCH --job-name=(\S+)", text)[1], script.name
    pytest.fail(f"no slurm/*.sbatch launches recipes/{name}.yaml")


@pytest.mark.parametrize("chain", [c for c in PIPELINES.values() if len(c) > 1],
                         ids=[k for k, c in PIPELINES.items() if len(c) > 1])
def test_each_stage_starts_from_the_last_checkpoint_of_the_one_before(chain):
    """Each stage has an sbatch file whose run folder is the recipe's save_dir, and the
    next stage's init_from names the stage before by its recipe (its run folder's last
    checkpoint, once finished: below), with the optimizer states."""
    previous = None
    for name, _ in chain:
        r = recipe(name)
        job, script = sbatch_of(name)
        assert r.train.save_dir == f"runs/{job}/checkpoints", script
        if previous is None:
            assert r.train.init_from is None
        else:
            assert r.train.init_from == f"recipes/{previous}.yaml", name
            assert r.train.init_optimizer
        previous = name


def _stage_one(tmp_path, steps_done: list[int], steps: int = 10):
    """A stage-1 recipe (train.steps=`steps`) whose run saved checkpoints at `steps_done`."""
    import yaml

    from megatron_stem.checkpoint.train_state import save_train_state
    from megatron_stem.config import TrainConfig, to_dict

    run = tmp_path / "stage1"
    stage = Recipe(model=tiny_model(), train=TrainConfig(steps=steps, save_dir=str(run)))
    for step in steps_done:
        with checkpoint.Writer(run, step, stage) as folder:
            save_train_state(folder, step, {})
    path = tmp_path / "stage1.yaml"
    path.write_text(yaml.safe_dump(to_dict(stage)))
    return path, run


def test_a_stage_before_its_predecessor_finished_is_refused(tmp_path):
    from megatron_stem.checkpoint.finding import stage_start

    path, run = _stage_one(tmp_path, [4, 8])
    for named in (path, run):  # by its recipe or its run folder
        with pytest.raises(UserError) as e:
            stage_start(str(named))
        assert str(e.value) == (
            f"train.init_from: {named}: that stage has not finished: its last complete "
            f"checkpoint, {run / 'iter_0000008'}, is at step 8 of its train.steps=10 (train it "
            f"to the end, or name {run / 'iter_0000008'} to start from it as it is)")
    assert stage_start(str(run / "iter_0000008")) == run / "iter_0000008"  # named as it is
    for folder in run.glob("iter_*"):
        (folder / "COMPLETE").unlink()
    with pytest.raises(UserError, match=r"^train\.init_from: .*stage1\.yaml: .*stage1 holds no "
                                        r"whole checkpoint \(each one refused above\)$"):
        stage_start(str(path))
    with pytest.raises(UserError, match=r"^train\.init_from: .*stage2\.yaml: its run folder "
                                        r".*stage2 does not exist: that stage has not started$"):
        stage_start(_missing_stage(tmp_path))


def _missing_stage(tmp_path) -> str:
    import yaml

    from megatron_stem.config import TrainConfig, to_dict

    path = tmp_path / "stage2.yaml"
    path.write_text(yaml.safe_dump(to_dict(Recipe(model=tiny_model(), train=TrainConfig(
        save_dir=str(tmp_path / "stage2"))))))
    return str(path)


def test_a_finished_stage_is_found_by_its_recipe_or_run_folder(tmp_path):
    from megatron_stem.checkpoint.checkpointer import Checkpointer
    from megatron_stem.checkpoint.finding import stage_start
    from megatron_stem.config import TrainConfig

    path, run = _stage_one(tmp_path, [5, 10])
    assert stage_start(str(path)) == stage_start(str(run)) == run / "iter_0000010"
    # The newest checkpoint damaged: the newest whole one before it, if it is at the end.
    (run / "iter_0000010" / "train_state.pt").unlink()
    with pytest.raises(UserError, match=r"is at step 5 of its train\.steps=10"):
        stage_start(str(path))
    path, _ = _stage_one(tmp_path, [], steps=5)  # the same run, its recipe at 5 steps
    assert stage_start(str(path)) == run / "iter_0000005"
    train = TrainConfig(save_dir=str(tmp_path / "stage2"), init_from=str(path))
    start = Checkpointer(Recipe(model=tiny_model(), train=train))
    assert start.origin() == f"initialized from {run / 'iter_0000005'} (weights)"


def _job_of_stage_one(tmp_path, monkeypatch, save_dir, *overrides, steps_done=(5, 10)):
    """Stage 1 as a job runs it (`python -m megatron_stem.train --recipe stage1.yaml
    train.save_dir=<the job's> ...`, launch.sh's command), its checkpoints already saved
    there, so the trainer only records where and says there is nothing left to train."""
    import yaml

    from megatron_stem.checkpoint.train_state import save_train_state
    from megatron_stem.config import TrainConfig, to_dict
    from megatron_stem.train import main

    monkeypatch.chdir(tmp_path)  # the recipe's own save dir is relative, as the shipped ones
    stage = Recipe(model=tiny_model(), train=TrainConfig(steps=10,
                                                         save_dir="runs/stage1/checkpoints"))
    path = tmp_path / "stage1.yaml"
    path.write_text(yaml.safe_dump(to_dict(stage)))
    saved = Recipe(model=tiny_model(), train=TrainConfig(steps=10, save_dir=str(save_dir)))
    for step in steps_done:
        with checkpoint.Writer(save_dir, step, saved) as folder:
            save_train_state(folder, step, {})
    monkeypatch.setenv("STEM_ALLOW_CPU", "1")
    assert main(["--recipe", str(path), f"train.save_dir={save_dir}", *overrides]) == 0
    return path


def test_stage_two_finds_stage_ones_checkpoints_under_stem_save_dir(tmp_path, monkeypatch,
                                                                    capsys, in_process_trainer):
    """A job of stage 1 with STEM_SAVE_DIR (or STEM_OUTPUT, another job name) saves
    elsewhere than its recipe says; `train.init_from: stage1.yaml` still finds it."""
    from megatron_stem.checkpoint.finding import stage_start

    elsewhere = tmp_path / "scratch" / "stage1-job" / "checkpoints"
    path = _job_of_stage_one(tmp_path, monkeypatch, elsewhere)
    record = tmp_path / "runs" / "stage1" / "checkpoints.where"
    assert f"stage: saving to {elsewhere}; a next stage's train.init_from: {path} reads it " \
           f"(runs/stage1/checkpoints.where)" in capsys.readouterr().out
    assert record.is_file() and not (tmp_path / "runs" / "stage1" / "checkpoints").exists()
    assert stage_start(str(path)) == elsewhere / "iter_0000010"

    # a trial of stage 1 (fewer steps) in its own folder changes nothing ...
    _job_of_stage_one(tmp_path, monkeypatch, tmp_path / "smoke", "train.steps=5",
                      steps_done=(5,))
    assert stage_start(str(path)) == elsewhere / "iter_0000010"
    # ... and a run where the recipe says removes the record: it is the stage now
    _job_of_stage_one(tmp_path, monkeypatch, tmp_path / "runs" / "stage1" / "checkpoints")
    assert not record.exists()
    assert stage_start(str(path)) == Path("runs/stage1/checkpoints/iter_0000010")


def test_check_of_stage_two_before_stage_one_finished_says_where_it_will_start(
        tmp_path, monkeypatch, capsys, in_process_trainer):
    from megatron_stem.config import TrainConfig, to_dict
    from megatron_stem.train import main

    import yaml

    elsewhere = tmp_path / "scratch" / "checkpoints"
    stage1 = _job_of_stage_one(tmp_path, monkeypatch, elsewhere)
    (elsewhere / "iter_0000010" / "COMPLETE").unlink()  # stage 1 is at step 5 of 10
    capsys.readouterr()
    stage2 = tmp_path / "stage2.yaml"
    stage2.write_text(yaml.safe_dump(to_dict(Recipe(model=tiny_model(), train=TrainConfig(
        save_dir=str(tmp_path / "stage2"), init_from=str(stage1))))))
    main(["--recipe", str(stage2), "--check"])
    out = capsys.readouterr().out.splitlines()
    assert f"start: will start from the last checkpoint in {elsewhere} when {stage1} " \
           "finishes (at step 5 of 10)" in out
    with pytest.raises(UserError, match="that stage has not finished"):  # training refuses
        Checkpointer(load_recipe(stage2))


def test_the_readme_walks_the_chain_with_the_recipes_paths():
    """Every stage's sbatch file, data recipe, token files (as preprocess_data.py's output
    prefix) and checkpoints are in the README; that its commands write what the next ones
    read is tests/test_docs.py's check."""
    readme = (ROOT / "README.md").read_text()
    for name, _ in PIPELINES["1b"]:
        r = recipe(name)
        for path in (f"slurm/{sbatch_of(name)[1]}", r.data.blend, r.train.save_dir,
                     *(s.prefix.removesuffix("_text_document") for s in r.data.sources)):
            assert path in readme, f"README: the 1B pipeline does not name {path}"


# --- data recipes ------------------------------------------------------------------------

def write(path, text: str):
    path.write_text(text)
    return path


def test_a_data_recipe_gives_the_prefixes_and_weights(tmp_path):
    blend = write(tmp_path / "mix.yaml", "sources:\n"
                  "  - {prefix: data/a_text_document, weight: 0.7, dataset: org/a}\n"
                  "  - {prefix: data/b_text_document, weight: 0.3}\n")
    r = load_recipe(ROOT / "recipes" / "tiny_cpu.yaml", [f"data.blend={blend}",
                                                           "data.prefixes=[]"])
    assert r.data.training_blend() == (["data/a_text_document", "data/b_text_document"],
                                       [0.7, 0.3])
    # Saved with a checkpoint, the recipe keeps the blend it read (the file may change).
    from megatron_stem.config import from_dict, to_dict

    blend.unlink()
    assert from_dict(Recipe, to_dict(r)).data.training_blend() == r.data.training_blend()


@pytest.mark.parametrize("text, error", [
    ("sources:\n  - {prefix: d/a, weigth: 1}\n",
     "sources[0].weigth: unknown field (did you mean 'weight'?)"),
    ("sources:\n  - {prefix: d/a, weight: high}\n",
     "sources[0].weight: expected a number, got 'high'"),
    ("sources:\n  - {prefix: d/a, weight: 0}\n", "sources[0].weight: must be positive, got 0.0"),
    ("sources: []\n", "sources: a data recipe needs at least one source"),
    ("sources:\n  - {prefix: d/a, weight: 1}\n  - {prefix: d/a, weight: 2}\n",
     "sources[1].prefix: d/a is listed twice"),
])
def test_data_recipe_errors_name_the_file_and_the_field(tmp_path, text, error):
    blend = write(tmp_path / "mix.yaml", text)
    stage = write(tmp_path / "stage.yaml", f"inherit: {ROOT / 'recipes' / 'tiny_cpu.yaml'}\n"
                  f"data:\n  prefixes: []\n  blend: {blend}\n")
    with pytest.raises(ConfigError) as e:
        load_recipe(stage)
    assert str(e.value) == f"{stage}: data.blend: {blend}: {error}"


def test_a_data_recipe_and_prefixes_together_are_refused(tmp_path):
    with pytest.raises(ConfigError) as e:  # the launcher's STEM_DATA on a blend recipe
        load_recipe(ROOT / "recipes" / "stem_1b_midtrain.yaml", ["data.prefixes=[d/x]"])
    assert str(e.value) == "command line: data.prefixes=[d/x]: the data is given by " \
        "data.blend (recipes/data/midtrain_llama3.yaml) too; give one of them " \
        "(data.blend=null to train on data.prefixes)"
    with pytest.raises(ConfigError, match=r"^command line: data\.blend=nope\.yaml: nope\.yaml: "
                                          r"data recipe file not found$"):
        load_recipe(ROOT / "recipes" / "tiny_cpu.yaml", ["data.blend=nope.yaml"])


def test_a_missing_token_file_names_its_source_in_the_data_recipe():
    from megatron_stem.training.batches import check_training_data

    with pytest.raises(UserError) as e:
        check_training_data(recipe("stem_1b_midtrain").data)
    assert str(e.value).startswith(
        "data.blend: recipes/data/midtrain_llama3.yaml: sources[0].prefix: "
        "data/olmo_mix/llama3/train_text_document.bin not found")


def test_init_optimizer_needs_init_from():
    with pytest.raises(ConfigError, match=r"^command line: train\.init_optimizer=true: needs "
                                          r"train\.init_from, the checkpoint whose optimizer"):
        load_recipe(ROOT / "recipes" / "tiny_cpu.yaml", ["train.init_optimizer=true"])


# --- what a stage may change --------------------------------------------------------------

def test_sequence_length_and_rope_base_may_change_but_not_parameter_shapes():
    saved = Recipe(model=tiny_model())
    longer = Recipe(model=tiny_model(seq_length=128, rotary_base=40000.0, norm_eps=1e-6,
                                     init_std=0.01))
    checkpoint.check_same_shape(saved, longer, "ckpt")  # a context-extension stage
    same_layers = Recipe(model=tiny_model([1, 3]))  # "1/2" of 4 layers, written out
    checkpoint.check_same_shape(saved, same_layers, "ckpt")
    wider = Recipe(model=tiny_model(ffn_hidden_size=256, seq_length=128))
    with pytest.raises(UserError, match=r"ckpt/recipe\.yaml: checkpoint is of another model "
                                        r"shape \(model\.ffn_hidden_size: checkpoint 128, "
                                        r"recipe 256\)$"):
        checkpoint.check_same_shape(saved, wider, "ckpt")
    grouped = Recipe(model=ModelConfig(**{**vars(tiny_model()), "num_query_groups": 4}))
    with pytest.raises(UserError, match=r"model\.num_query_groups: checkpoint 2, recipe 4"):
        checkpoint.check_same_shape(saved, grouped, "ckpt")


def test_a_model_loaded_from_another_rope_base_uses_its_own(world1, tmp_path):
    """The context extension's RoPE base is the new recipe's: no buffer of the saved
    model's positions comes back with its weights."""
    import torch

    from megatron_stem.config import ParallelConfig
    from megatron_stem.model import build_model

    short = Recipe(model=tiny_model(seq_length=16, rotary_base=10000.0))
    saved = build_model(short.model, ParallelConfig())
    with checkpoint.Writer(tmp_path, 1, short) as folder:
        checkpoint.save_model(saved, folder)

    def loaded(rotary_base: float):
        model = build_model(tiny_model(seq_length=64, rotary_base=rotary_base), ParallelConfig())
        checkpoint.load_model(model, tmp_path / "iter_0000001")
        return model.eval()

    def by_hand(rotary_base: float):  # the saved weights put in by hand, nothing else
        model = build_model(tiny_model(seq_length=64, rotary_base=rotary_base), ParallelConfig())
        model.load_state_dict(saved.state_dict())
        return model.eval()

    tokens = torch.randint(0, 300, (1, 64))
    with torch.no_grad():
        extended = loaded(160000.0)(tokens, None, None)
        assert torch.equal(extended, by_hand(160000.0)(tokens, None, None))
        assert not torch.allclose(extended, loaded(10000.0)(tokens, None, None), atol=1e-3)


def test_init_optimizer_from_a_weights_only_checkpoint_is_a_clear_error(world1, tmp_path):
    from megatron_stem.checkpoint.checkpointer import Checkpointer
    from megatron_stem.config import ParallelConfig, TrainConfig
    from megatron_stem.model import build_model

    source = tmp_path / "imported"
    with checkpoint.Writer(source, 0, Recipe(model=tiny_model())) as folder:
        checkpoint.save_model(build_model(tiny_model(), ParallelConfig()), folder)
    train = TrainConfig(save_dir=str(tmp_path / "run"), init_from=str(source),
                        init_optimizer=True)
    with pytest.raises(UserError, match=r"^train\.init_optimizer: .*imported/iter_0000000 "
                                        r"holds model weights only .*init_optimizer=false"):
        Checkpointer(Recipe(model=tiny_model(), train=train))


# --- the memory plan ---------------------------------------------------------------------

def test_memory_per_gpu_of_the_32k_recipe_is_the_hand_count():
    """stem_1b_long on 4 x 8 H200 (TP1, DP32, one micro-batch of 1 x 32,768 tokens per
    rank, bf16, ZeRO-1, device tables with their state sharded in CPU memory), counted by
    hand from the model's shape, with 7,000 distinct rows per rank per step."""
    from megatron_stem.planning import hardware, memory
    from megatron_stem.planning.step import Cluster

    plan = memory.memory_per_gpu(recipe("stem_1b_long"), Cluster(4, 8),
                                 hardware.load("h100"), rank_rows=7000)
    d, ff, vocab, layers, tokens = 2048, 8192, 128256, 16, 32768
    attention = d * 64 * (2 * 32 + 2 * 8)
    active = 2 * vocab * d + layers * (attention + 3 * d * ff + 2 * d) + d - 5 * d * ff
    table = 5 * vocab * ff
    expected = {
        "parameters": 2 * active,
        "gradients": 2 * active + 2 * tokens * 5 * ff + 4 * 7000 * 5 * ff,
        "optimizer": 12 * active / 32,
        "tables": 2 * table,
        # the FFN activation recomputed (2 x ffn B less per layer, one layer's back), the
        # loss in chunks of 4,096 positions and the output weight's fp32 gradient sum
        "activations": (34 * layers - 2 * ff / d * (layers - 1)) * tokens * d
        + (4 + 2) * 4096 * vocab + 4 * vocab * d,
    }
    for kind, value in expected.items():
        assert plan.total(kind) == pytest.approx(value, rel=1e-12), kind
    assert plan.host == 12 * 5 * (-(-vocab // 32)) * ff  # the tables' state: in CPU memory
    assert plan.total() == pytest.approx(sum(expected.values()))
    assert plan.total() <= 0.9 * 80e9  # an H100 with 10% to spare


NO_RECOMPUTE = ("parallel.recompute=none", "parallel.recompute_modules=[]")


def test_recompute_and_state_on_the_gpus_move_memory_where_they_should():
    from megatron_stem.planning import hardware, memory
    from megatron_stem.planning.step import Cluster

    def plan(*overrides):
        r = load_recipe(ROOT / "recipes" / "stem_1b_long.yaml", [*NO_RECOMPUTE, *overrides])
        return memory.memory_per_gpu(r, Cluster(4, 8), hardware.load("h200"), rank_rows=7000)

    base = plan()
    recompute = plan("parallel.recompute=full")
    d, tokens, layers = 2048, 32768, 16
    assert base.total("activations") - recompute.total("activations") == pytest.approx(
        (34 * layers - 2 * layers - 34) * tokens * d)
    gpu = plan("optimizer.tables.device=accelerator")
    state = 12 * 5 * (-(-128256 // 32)) * 8192
    assert gpu.total("tables") - base.total("tables") == pytest.approx(state)
    assert base.host == pytest.approx(state) and gpu.host == 0
    host = plan("optimizer.tables.device=cpu", "tables.placement=host", "tables.overlap=none")
    assert host.total("tables") < 2e9 < 10e9 < base.total("tables")  # staged rows only


def test_the_chunked_loss_keeps_one_chunk_of_logits_and_pays_one_output_gemm():
    """`parallel.loss_chunk_tokens`: the memory of one chunk's logits (and the output
    weight's fp32 gradient sum) instead of every position's; the step time one more
    output-layer GEMM per token, at the compute's rate."""
    from megatron_stem.planning import hardware, memory
    from megatron_stem.planning.compute import compute_components
    from megatron_stem.planning.step import Cluster, workload

    def both(*overrides):
        r = load_recipe(ROOT / "recipes" / "stem_1b_long.yaml",
                        ["parallel.loss_chunk_tokens=0", *overrides])
        h100 = hardware.load("h100")
        return (memory.memory_per_gpu(r, Cluster(4, 8), h100, rank_rows=7000),
                compute_components(workload(r, Cluster(4, 8)), Cluster(4, 8), h100))

    (whole, whole_compute), (chunked, chunked_compute) = both(), \
        both("parallel.loss_chunk_tokens=2048")
    d, vocab, tokens = 2048, 128256, 32768
    assert whole.total("activations") - chunked.total("activations") == pytest.approx(
        (4 + 2) * (tokens - 2048) * vocab - 4 * vocab * d)
    extra = [c for c in chunked_compute if c.name.startswith("forward recomputed")]
    assert not any(c.name.startswith("forward recomputed") for c in whole_compute)
    assert extra[0].amount == pytest.approx(2 * d * vocab * tokens)
    at_mfu = whole_compute[0]
    assert extra[0].seconds == pytest.approx(at_mfu.seconds * extra[0].amount / at_mfu.amount)


@pytest.mark.parametrize("modules, freed, flops", [
    ("[mlp_act]", 2 * 8192, 0),  # silu(gate) x up: elementwise, no GEMM again
    ("[core_attn]", 0, 4 * 16 * 2048 * 32768),  # flash-style: no s^2 scores counted
    ("[mlp]", 4 * 8192 + 2048, 2 * 2048 * 8192 * (3 * 11 + 2 * 5)),  # 11 dense, 5 STEM
])
def test_selective_recompute_frees_its_modules_and_pays_their_forward(modules, freed, flops):
    """Each layer keeps `freed` bytes per token less (one layer's come back while it is
    recomputed); the step computes their forward FLOPs again."""
    from megatron_stem.planning import hardware, memory
    from megatron_stem.planning.step import Cluster, workload

    def plan(*overrides):
        r = load_recipe(ROOT / "recipes" / "stem_1b_long.yaml", [*NO_RECOMPUTE, *overrides])
        return (memory.memory_per_gpu(r, Cluster(4, 8), hardware.load("h100"), rank_rows=7000),
                workload(r, Cluster(4, 8)))

    (base, base_w), (selective, w) = plan(), plan("parallel.recompute=selective",
                                                  f"parallel.recompute_modules={modules}")
    tokens, layers = 32768, 16
    assert base.total("activations") - selective.total("activations") == pytest.approx(
        (layers - 1) * freed * tokens)
    assert w.recompute_flops_per_token - base_w.recompute_flops_per_token == \
        pytest.approx(flops)


def test_plan_step_prints_the_memory_and_ends_with_the_step_time_line(capsys):
    assert tool_main("tools/plan_step.py")(["--recipe", "recipes/stem_1b_long.yaml", "--baseline",
                      "recipes/dense_1b_long.yaml", "--nodes", "4", "--hardware", "h200",
                      "--details"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("predicted step time STEM ")
    titles = [i for i, line in enumerate(out) if line.startswith("memory per GPU")]
    assert len(titles) == 2
    stem = out[titles[1]:]
    for kind in ("parameters:", "gradients:", "optimizer:", "tables:", "activations:"):
        assert any(line.strip().startswith(kind) for line in stem), kind
    assert any("of 141 GB: fits" in line for line in stem)


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

@pytest.mark.integration  # the trainer runs under torchrun
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

@pytest.mark.integration  # the trainer runs under torchrun
def test_a_stage_initialized_at_another_layout_follows_the_same_curve(train, midtrain,
                                                                      tmp_path):
    """Stage 2 on two ranks, the tables' optimizer state now sharded over both (stage 1
    kept it whole on one rank), killed at step 3 and resumed: the single-rank stage 2's
    curve. (The resume restores the Adam step count stage 2 carried on from stage 1.)"""
    first = train(2, *midtrain["options"], save_dir=tmp_path, preempt_at=3, name="mid_dp2")
    second = train(2, *midtrain["options"], save_dir=tmp_path, name="mid_dp2_resumed")
    assert first["step"] == 3 and second["step"] == 6
    assert_same_curve(first["losses"] + second["losses"], midtrain["run"]["losses"])

@pytest.mark.integration  # the trainer runs under torchrun
def test_init_from_without_the_optimizer_starts_a_fresh_one(train, midtrain):
    """Weights only: the same weights see the same first batch, then a fresh optimizer
    (Adam moments of zero, step 1) takes other steps than the carried-over states."""
    fresh = train(1, *midtrain["weights_only"], name="init_from_weights")
    assert "(weights)" in fresh["log"]
    carried = midtrain["run"]["losses"]
    assert fresh["step"] == 6 and fresh["losses"][0] == carried[0]
    assert all(abs(a - b) > 1e-4 for a, b in zip(fresh["losses"][1:], carried[1:]))


@pytest.mark.integration  # the trainer runs under torchrun
def test_a_stem_run_starts_from_a_dense_runs_checkpoint_and_trains(train, reference):
    """The dense baseline's last checkpoint starts the STEM model (its STEM layers' up
    projections dropped, fresh tables: tests/training/test_stages.py checks the weights): the
    run starts below a fresh STEM model's first loss and trains on."""
    dense = train(1, "model.stem_layers=none", name="dense_stage1")
    stem = train(1, f"train.init_from={dense['save_dir']}", name="stem_from_dense")
    source = dense["save_dir"] / "iter_0000006"
    assert f"initialized from {source} (a dense model's weights: STEM layers' " \
           "up-projections dropped, fresh tables)" in stem["log"]
    assert stem["step"] == 6 and stem["losses"][-1] < stem["losses"][0]
    assert stem["losses"][0] < reference["lazy"]["losses"][0] - 0.1
