"""Quality of the two table update semantics (`optimizer.tables.update: lazy | dense`), side
by side in one run: the same recipe, data, seed and steps, trained once per semantics (and
once as the dense-FFN baseline), through the real trainer. Prints validation loss per evaluation.

    bash tools/quickstart.sh train.steps=1        # once: tokenizer and .bin/.idx data
    python bench/table_semantics.py [--steps 300] [override ...]

`bench/table_optim.py` measures what each semantics costs; this measures what it learns.
"""

import argparse
import math
import tempfile
import time

from megatron_stem.config import load_recipe
from megatron_stem.training.loop import run


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="recipes/tiny_cpu.yaml")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", default="1234", help="comma-separated train.seed values")
    ap.add_argument("--variants", default="lazy,dense,baseline",
                    help="lazy, dense (table semantics) and baseline (no STEM layers)")
    ap.add_argument("overrides", nargs="*", help="recipe overrides, section.field=value")
    args = ap.parse_args()
    variant_overrides = {"lazy": ["optimizer.tables.update=lazy"],
                         "dense": ["optimizer.tables.update=dense"],
                         "baseline": ["model.stem_layers=none"]}
    valid, seconds = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds.split(","):
            for variant in args.variants.split(","):
                recipe = load_recipe(args.recipe, [
                    *args.overrides, *variant_overrides[variant], f"train.seed={seed}",
                    f"train.steps={args.steps}", f"train.save_dir={tmp}/{variant}_{seed}",
                    f"train.save_interval={args.steps}", "train.log_interval=100000"])
                start = time.perf_counter()
                valid[variant, seed] = run(recipe)["valid"]
                seconds[variant, seed] = time.perf_counter() - start
    evals = list(range(recipe.train.eval_interval, args.steps, recipe.train.eval_interval))
    evals.append(args.steps)
    print(f"{args.recipe}, {args.steps} steps, seeds {args.seeds}: validation loss (ppl)")
    print(f"{'variant':<10}{'seed':<6}" + "".join(f"{'step ' + str(s):>18}" for s in evals)
          + f"{'s':>8}")
    for (variant, seed), losses in valid.items():
        print(f"{variant:<10}{seed:<6}" + "".join(
            f"{loss:>10.4f} ({math.exp(loss):>5.1f})" for loss in losses)
            + f"{seconds[variant, seed]:>8.0f}")


if __name__ == "__main__":
    main()
