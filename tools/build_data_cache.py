"""Build a training stage's dataset indices ahead of time, into its shared data cache.

    python tools/build_data_cache.py --recipe recipes/stem_1b_pretrain.yaml --ranks 32 \\
        [--workers 16] [section.field=value ...]

Run it on a CPU node before the stage's first job (the stage's sbatch runs it as its first
step too: nothing to do when the cache is there). Every run of the same data, split, seed,
sequence length and batch then starts without building anything: the dense and STEM runs
of a stage, every requeue. Prefixes are indexed in `--workers` processes, with a line per
prefix, then blended on `--workers` threads; a killed build resumes where it stopped, and
builds only what is missing. `--ranks` is the run's number of GPUs (its validation batches
depend on it). docs/data.md, "Training data at scale".
"""

import argparse
import os
import sys
import time

from megatron_stem.config import load_recipe
from megatron_stem.runtime.errors import UserError, cli


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", required=True, help="the stage's training recipe")
    ap.add_argument("--ranks", type=int, required=True,
                    help="the run's number of ranks (nodes x GPUs per node)")
    ap.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                    help="processes indexing prefixes, then threads blending them "
                         "(default: every CPU this process may use)")
    ap.add_argument("overrides", nargs="*", help="recipe overrides section.field=value")
    return ap.parse_args(argv)


@cli
def main(argv=None) -> int:
    args = parse_args(argv)
    recipe = load_recipe(args.recipe, args.overrides)
    if args.workers < 1:
        raise UserError(f"--workers: must be >= 1, got {args.workers}")
    from megatron_stem.data import sample_cache
    from megatron_stem.config.world import data_parallel_size
    from megatron_stem.training.batches import Samples, plans
    from megatron_stem.training.checks import load_tokenizer

    start = time.perf_counter()
    samples = Samples.of(recipe, data_parallel_size(recipe.parallel, args.ranks, "--ranks"))
    run_plans = list(plans(recipe, load_tokenizer(recipe), samples).values())
    cache = run_plans[0].config.path_to_cache
    missing = sample_cache.missing_of(run_plans)
    prefixes = sum(len(p.prefixes) for p in run_plans)
    if not missing:
        print(f"up to date: {cache} holds every index of the {prefixes} prefixes")
        return 0
    print(f"building into {cache}: {sum(len(m) for _, m in missing)} index(es) of "
          f"{prefixes} prefixes, ~{sum(p.build_seconds(m) for p, m in missing) / 60:.1f} min "
          "on one core", flush=True)
    sample_cache.build([plan for plan, _ in missing], args.workers,
                       progress=lambda line: print(line, flush=True))
    print(f"done in {time.perf_counter() - start:.1f} s: {cache} holds "
          f"{sample_cache.cache_bytes(cache) / 1e9:.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
