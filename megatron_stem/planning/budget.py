"""What a recipe costs to train to its end on a cluster: GPU-hours from the step planner's
step time, and the storage the stage needs beside its token files (the data cache, the
checkpoints it keeps). Predicted, not measured: `--check` prints it (training/preflight.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_stem.config import Recipe
from megatron_stem.model.accounting import account
from megatron_stem.planning import step
from megatron_stem.planning.hardware import Hardware
from megatron_stem.planning.workload import Cluster, workload

# Per parameter, beside its weight: the fp32 master copy and two Adam moments.
OPTIMIZER_STATE_BYTES = 12
# A GPU node's CPU memory the planner assumes (DGX H100/H200: 2 TB).
NODE_HOST_MEMORY = 2048e9


def checkpoint_bytes(recipe: Recipe) -> float:
    """One checkpoint: every parameter's weight in the training dtype (host tables in fp32)
    and its optimizer states."""
    counts = account(recipe.model)
    weight = 2 if recipe.train.dtype == "bf16" else 4
    table_weight = 4 if recipe.tables.placement == "host" else weight
    backbone = counts.stored_params - counts.table_params
    return backbone * (weight + OPTIMIZER_STATE_BYTES) + \
        counts.table_params * (table_weight + OPTIMIZER_STATE_BYTES)


def configured_plan(recipe: Recipe, cluster: Cluster, hw: Hardware) -> step.Plan:
    """The planner's step of `recipe` as configured (its table option)."""
    w = workload(recipe, cluster)
    option = step.configured_option(recipe) if recipe.model.is_stem else None
    return step.plan(w, option, cluster, hw, NODE_HOST_MEMORY)


def step_seconds(recipe: Recipe, cluster: Cluster, hw: Hardware) -> float:
    return configured_plan(recipe, cluster, hw).step_s


@dataclass(frozen=True)
class Budget:
    """A stage's cost on `gpus` GPUs; the storage figures in bytes, None where unknown."""

    steps: int
    tokens: int  # trained: steps x global batch x sequence
    step_s: float
    gpus: int
    token_files: Optional[float]
    token_files_from: str
    cache: Optional[float]
    cache_from: str
    checkpoint: float
    kept: int
    kept_from: str

    @property
    def gpu_hours(self) -> float:
        return self.step_s * self.steps * self.gpus / 3600

    def lines(self) -> list[str]:
        days = self.step_s * self.steps / 86400
        files = "unknown" if self.token_files is None else _bytes(self.token_files)
        cache = "unknown" if self.cache is None else _bytes(self.cache)
        return [
            f"budget: {self.tokens / 1e9:,.1f}B tokens trained in {self.steps:,} steps",
            f"  GPU time: {self.step_s:.3f} s per step (the step planner) x {self.steps:,} "
            f"steps = {days:.1f} days on {self.gpus} GPUs, {self.gpu_hours:,.0f} GPU-hours",
            f"  storage: token files {files} ({self.token_files_from}), data cache {cache} "
            f"({self.cache_from}), checkpoints {_bytes(self.checkpoint)} x {self.kept} kept "
            f"({self.kept_from}) = {_bytes(self.checkpoint * self.kept)}",
        ]


def _bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n / 1e3:.1f} kB"
