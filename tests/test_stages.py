"""The paper's training pipeline as recipes: token budgets, the chain of stages, data
recipes, what a stage may change of the model it starts from, and the memory plan."""

import re

import pytest

from conftest import ROOT, tool_main
from megatron_stem import checkpoint
from megatron_stem.config import ModelConfig, Recipe, load_recipe
from megatron_stem.runtime.errors import ConfigError, UserError
from workers.common import tiny_model

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

    from megatron_stem.config import TrainConfig, to_dict
    from megatron_stem.checkpoint.train_state import save_train_state

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
    from megatron_stem.config import TrainConfig
    from megatron_stem.checkpoint.checkpointer import Checkpointer
    from megatron_stem.checkpoint.finding import stage_start

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
    from megatron_stem.config import ParallelConfig, TrainConfig
    from megatron_stem.model import build_model
    from megatron_stem.checkpoint.checkpointer import Checkpointer

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
                      "recipes/dense_1b_long.yaml", "--nodes", "4", "--hardware", "h200"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("predicted step time STEM ")
    titles = [i for i, line in enumerate(out) if line.startswith("memory per GPU")]
    assert len(titles) == 2
    stem = out[titles[1]:]
    for kind in ("parameters:", "gradients:", "optimizer:", "tables:", "activations:"):
        assert any(line.strip().startswith(kind) for line in stem), kind
    assert any("of 141 GB: fits" in line for line in stem)
