"""The rules between a recipe and the ranks that run it (config/world.py): what the trainer
refuses at start and `--check` reports for a job's size, each on its own."""

import pytest

from megatron_stem.config import load_recipe
from megatron_stem.config.world import check_world, data_parallel_size, world_problems
from megatron_stem.runtime.errors import ConfigError, UserError
from support.processes import ROOT

PRETRAIN = ROOT / "recipes" / "stem_1b_pretrain.yaml"


def recipe(*overrides):
    return load_recipe(PRETRAIN, list(overrides))


def test_data_parallel_is_the_ranks_over_a_model_replica_s():
    parallel = recipe("parallel.tensor_parallel=2").parallel
    assert data_parallel_size(parallel, 32, "--ranks") == 16
    with pytest.raises(UserError, match=r"--ranks: 5 is not a positive multiple of "
                                        r"parallel.tensor_parallel x .* \(2\)"):
        data_parallel_size(parallel, 5, "--ranks")


def test_the_1b_recipe_fits_its_sbatch_size_and_twice_it():
    assert world_problems(recipe(), 32, 8) == []
    assert world_problems(recipe(), 64, 8) == []


def test_sharded_tables_need_a_data_parallel_size_that_divides_the_vocabulary():
    r = recipe("train.global_batch_size=640", "train.micro_batch_size=2")
    line = ("tables.partition: sharded splits the 128,256 table rows (model.vocab_size) evenly "
            "over the 40 data-parallel ranks, and 40 does not divide 128,256; use a "
            "data-parallel size that does (32 or 48), or tables.partition=replicated")
    assert world_problems(r, 40, 8) == [line]
    with pytest.raises(ConfigError, match=r"^tables\.partition: sharded splits"):
        check_world(r, 40, 8)  # the trainer's start, in the same words
    replicated = recipe("train.global_batch_size=640", "train.micro_batch_size=2",
                        "tables.partition=replicated", "tables.overlap=none")
    assert world_problems(replicated, 40, 8) == []
    # tensor parallelism leaves fewer data-parallel ranks to split over
    assert world_problems(recipe("parallel.tensor_parallel=2", "train.global_batch_size=640",
                                 "train.micro_batch_size=4"), 80, 8) == [line]


def test_a_dense_model_has_no_tables_to_split():
    dense = load_recipe(ROOT / "recipes" / "dense_1b_pretrain.yaml",
                        ["train.global_batch_size=640", "train.micro_batch_size=2"])
    assert world_problems(dense, 40, 8) == []


def test_a_world_the_layout_does_not_divide_is_the_only_problem_said():
    assert world_problems(recipe("parallel.tensor_parallel=4"), 30, 6) == [
        "parallel: world size 30 is not divisible by tensor_parallel x pipeline_parallel = 4"]


def test_the_batch_must_divide_over_the_data_parallel_ranks():
    assert world_problems(recipe(), 48, 8) == [
        "train.global_batch_size: 512 is not a multiple of micro_batch_size x data-parallel "
        "size = 192"]


@pytest.mark.parametrize("overrides, ranks_per_node, problem", [
    (["tables.ranks_per_copy=3"], 8,
     "tables.ranks_per_copy: 3 does not divide the 8 data-parallel ranks of one slice on a node"),
    (["tables.ranks_per_copy=2", "parallel.tensor_parallel=2"], 8, None),
    (["tables.partition=replicated"], 5,
     "tables.partition: replicated splits the 128,256 table rows of a host copy evenly over "
     "its 5 ranks, and 5 does not divide 128,256; set tables.ranks_per_copy to a divisor of it"),
    (["tables.partition=replicated", "tables.ranks_per_copy=1"], 5, None),
])
def test_host_tables_split_over_the_ranks_of_a_node_that_share_a_copy(
        overrides, ranks_per_node, problem):
    world = 4 * ranks_per_node
    r = recipe("tables.placement=host", "tables.overlap=none",
               f"train.global_batch_size={4 * world}", *overrides)
    assert world_problems(r, world, ranks_per_node) == \
        ([problem] if problem else [])


def test_one_rank_cannot_share_a_host_copy():
    r = recipe("tables.placement=host", "tables.overlap=none", "tables.ranks_per_copy=2",
               "train.global_batch_size=4")
    assert world_problems(r, 1, 1) == [
        "tables.ranks_per_copy: 2 ranks per copy but this run has one rank"]
