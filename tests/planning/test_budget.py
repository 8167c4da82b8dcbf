"""A stage's budget (planning/budget.py): a checkpoint's bytes as the save's own tensors
add up, and GPU time from the step the planner's command line predicts."""

import importlib.util
import re
import subprocess
import sys

from megatron_stem.config import load_recipe
from megatron_stem.planning import budget, hardware
from megatron_stem.planning.workload import Cluster
from support.processes import ROOT, subprocess_env


def bench_module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_checkpoint_is_every_saved_tensor():
    """bench/checkpoint_storage.py lists the 1B save's matrices tensor by tensor (its rank loads);
    the budget counts parameters: the same bytes and the norms' weights, dense and STEM,
    device and host tables."""
    tensors_1b = bench_module("checkpoint_storage").tensors_1b
    for name, overrides in (("stem_1b", []), ("dense_1b", []),
                            ("stem_1b", ["tables.placement=host", "tables.overlap=none"])):
        recipe = load_recipe(ROOT / "recipes" / f"{name}.yaml", overrides)
        m = recipe.model
        norms = (2 * m.num_layers + 1) * m.hidden_size  # two per layer, the final one
        assert budget.checkpoint_bytes(recipe) == sum(map(sum, tensors_1b(recipe))) + \
            norms * (2 + budget.OPTIMIZER_STATE_BYTES)
    assert round(budget.checkpoint_bytes(load_recipe(ROOT / "recipes" / "stem_1b.yaml")) / 1e9,
                 1) == 93.4


def test_gpu_time_is_the_planners_step_of_the_recipe_as_configured(tmp_path):
    proc = subprocess.run(
        [sys.executable, "tools/plan_step.py", "--recipe", "recipes/stem_1b_pretrain.yaml",
         "--baseline", "recipes/dense_1b_pretrain.yaml", "--nodes", "4", "--gpus-per-node",
         "8", "--hardware", "h100"], capture_output=True, text=True, cwd=ROOT,
        env=subprocess_env(HOME=str(tmp_path)))  # no refit profile: the published numbers
    stem, dense = map(float, re.search(r"STEM (\d+\.\d+) s, dense (\d+\.\d+) s",
                                       proc.stdout).groups())
    cluster, hw = Cluster(4, 8), hardware.PUBLISHED["h100"]
    for name, seconds in (("stem_1b_pretrain", stem), ("dense_1b_pretrain", dense)):
        recipe = load_recipe(ROOT / "recipes" / f"{name}.yaml")
        assert round(budget.step_seconds(recipe, cluster, hw), 3) == seconds
    b = budget.Budget(steps=954_000, tokens=0, step_s=stem, gpus=32, token_files=None,
                      token_files_from="", cache=None, cache_from="", checkpoint=1e9, kept=3,
                      kept_from="train.keep_last")
    assert b.gpu_hours == stem * 954_000 * 32 / 3600
    assert f"= {stem * 954_000 / 86400:.1f} days on 32 GPUs, {b.gpu_hours:,.0f} GPU-hours" \
        in b.lines()[1]
