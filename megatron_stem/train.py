"""Pretrain a STEM model (or its dense baseline).

    torchrun --nproc_per_node N -m megatron_stem.train --recipe recipes/stem_1b.yaml \
        [section.field=value ...]

Resumes from `<train.save_dir>/latest` when there is one; on SIGUSR1/SIGTERM (SLURM
preemption, `--signal`) saves a checkpoint and exits with `EXIT_REQUEUE`. `--stop-after N`
ends a trial after step N (the acceptance run's stages, docs/acceptance.md).

This module is the command line only: the loop is `training/loop.py`, `--print-config`
and `--check` (both at once: the recipe, then its checks) are `training/preflight.py`.
"""

# ruff: noqa: E402  (the imports come after the stop handler's installation)
from __future__ import annotations

from megatron_stem.runtime import process_lifetime
from megatron_stem.training.stop import catch_stop_signals, end_with_launcher

if __name__ == "__main__":  # a rank: a stop signal during the slow imports below is caught
    catch_stop_signals()
    end_with_launcher()

import argparse

from megatron_stem.checkpoint.finding import record_stage
from megatron_stem.config import RecipeSource, load_recipe
from megatron_stem.planning import hardware
from megatron_stem.runtime import warning_filters
from megatron_stem.runtime.errors import UserError, cli
from megatron_stem.training import preflight
from megatron_stem.training.loop import run
from megatron_stem.training.stop import EXIT_REQUEUE


@cli
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_stem.train",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", required=True, help="a YAML file in recipes/")
    parser.add_argument("overrides", nargs="*", help="section.field=value (YAML values)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved recipe, each value with the file or override "
                             "it came from, and exit")
    parser.add_argument("--check", action="store_true",
                        help="run every check that can run before training (fields, data "
                             "files, tokenizer, checkpoints; with --gpus-per-node the job's "
                             "layout, memory per GPU and budget) and exit: 2 and every "
                             "problem, one per line, if any")
    parser.add_argument("--nodes", type=int,
                        help="--check: nodes of the job (default 1)")
    parser.add_argument("--gpus-per-node", type=int,
                        help="--check: GPUs per node (checks the layout, memory per GPU and "
                             "the budget on nodes x GPUs)")
    parser.add_argument("--hardware",
                        help=f"--check: the GPU to plan for, {' or '.join(hardware.PUBLISHED)}"
                             " (the published profile, or its refit in the planner's cache), "
                             "or a profile file (an acceptance run's refit, <name>.json) "
                             "(default: the one nvidia-smi finds here; on a machine without "
                             "one, required with --gpus-per-node)")
    parser.add_argument("--stop-after", type=int, metavar="N",
                        help="end after step N without saving or evaluating it: a trial of "
                             "the recipe's first steps (its schedule, data and the saves due "
                             "before N as the recipe says)")
    args = parser.parse_args(argv)
    cluster_flags = [flag for flag, value in (("--nodes", args.nodes),
                                              ("--gpus-per-node", args.gpus_per_node),
                                              ("--hardware", args.hardware))
                     if value is not None]
    if cluster_flags and not args.check:
        raise UserError(f"{', '.join(cluster_flags)}: describe the job for --check; add "
                        "--check (training itself takes its size from torchrun)")
    for flag, value in (("--nodes", args.nodes), ("--gpus-per-node", args.gpus_per_node),
                        ("--stop-after", args.stop_after)):
        if value is not None and value < 1:
            raise UserError(f"{flag}: must be >= 1, got {value}")
    if args.print_config or args.check:
        source = RecipeSource.read(args.recipe, args.overrides)
        if not args.check:
            return preflight.print_config(source)
        target = preflight.Target.given(args.nodes or 1, args.gpus_per_node, args.hardware)
        if args.print_config:
            return preflight.print_and_check(source, target)
        return preflight.check(source, target)
    warning_filters.other_ranks_quiet()
    recipe = load_recipe(args.recipe, args.overrides)
    record_stage(args.recipe, recipe)  # where a next stage's init_from finds this run
    result = run(recipe, stop_after=args.stop_after)
    return EXIT_REQUEUE if result["preempted"] else 0


if __name__ == "__main__":
    process_lifetime.exit_soon(main())  # a thread a library left running keeps no finished rank
