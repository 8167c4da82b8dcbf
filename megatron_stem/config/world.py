"""The rules between a recipe and the ranks that run it, which only a job's size decides:
the layout divides the world, the batch divides over data parallel, the tables' rows
divide over the ranks that share them. The trainer checks them on every rank before it
builds anything (`training/loop.py`), `--check` on the cluster it is given
(`training/preflight.py`): the same lines either way, each naming the field to change."""

from __future__ import annotations

from megatron_stem.config.schema import ParallelConfig, Recipe
from megatron_stem.config.table_layout import TableLayout
from megatron_stem.runtime.errors import ConfigError, UserError


def world_problems(recipe: Recipe, world: int, ranks_per_node: int) -> list[str]:
    """Every rule `recipe` breaks on `world` ranks, `ranks_per_node` on each node."""
    par, train, model = recipe.parallel, recipe.train, recipe.model
    model_parallel = par.tensor_parallel * par.pipeline_parallel
    if world % model_parallel:  # nothing else can be split
        return [f"parallel: world size {world} is not divisible by tensor_parallel x "
                f"pipeline_parallel = {model_parallel}"]
    dp = world // model_parallel
    problems = []
    if train.global_batch_size % (train.micro_batch_size * dp):
        problems.append(f"train.global_batch_size: {train.global_batch_size} is not a multiple "
                        f"of micro_batch_size x data-parallel size = "
                        f"{train.micro_batch_size * dp}")
    if model.is_stem:
        problems += _table_problems(recipe, world, dp, ranks_per_node)
    return problems


def data_parallel_size(parallel: ParallelConfig, ranks: int, field: str) -> int:
    """A run of `ranks` ranks' data-parallel size, as megatron's parallel state makes it:
    the ranks over each model replica's (tensor x pipeline parallel)."""
    replica = parallel.tensor_parallel * parallel.pipeline_parallel
    if ranks < 1 or ranks % replica:
        raise UserError(f"{field}: {ranks} is not a positive multiple of "
                        f"parallel.tensor_parallel x parallel.pipeline_parallel ({replica})")
    return ranks // replica


def check_world(recipe: Recipe, world: int, ranks_per_node: int) -> None:
    """`world_problems`, the first of them raised."""
    problems = world_problems(recipe, world, ranks_per_node)
    if problems:
        raise ConfigError(problems[0])


def _table_problems(recipe: Recipe, world: int, dp: int, ranks_per_node: int) -> list[str]:
    layout, vocab = TableLayout.of(recipe), recipe.model.vocab_size
    if layout.sharded and vocab % dp:
        return [f"tables.partition: sharded splits the {vocab:,} table rows (model.vocab_size) "
                f"evenly over the {dp} data-parallel ranks, and {dp} does not divide "
                f"{vocab:,}; use a data-parallel size that does ({_near_divisors(vocab, dp)}), "
                "or tables.partition=replicated"]
    if not layout.on_host:
        return []
    per_copy = recipe.tables.ranks_per_copy
    if world == 1:
        return [f"tables.ranks_per_copy: {per_copy} ranks per copy but this run has one rank"
                ] if per_copy > 1 else []
    # A host copy is shared by a node's data-parallel ranks of one tensor-parallel slice.
    per_slice = max(1, ranks_per_node // recipe.parallel.tensor_parallel)
    per = per_copy or per_slice
    if per_slice % per:
        return [f"tables.ranks_per_copy: {per} does not divide the {per_slice} data-parallel "
                "ranks of one slice on a node"]
    if not layout.sharded and vocab % per:
        return [f"tables.partition: replicated splits the {vocab:,} table rows of a host copy "
                f"evenly over its {per} ranks, and {per} does not divide {vocab:,}; set "
                "tables.ranks_per_copy to a divisor of it"]
    return []


def _near_divisors(n: int, k: int) -> str:
    """The divisors of `n` nearest to `k`, below and above, as "16 or 32"."""
    below = next(d for d in range(k, 0, -1) if n % d == 0)
    above = next((d for d in range(k, n + 1) if n % d == 0), None)
    return " or ".join(str(d) for d in (below, above) if d is not None)
