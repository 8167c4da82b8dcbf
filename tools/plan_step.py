"""Predict a recipe's step time and memory per GPU on a cluster (against a baseline).

    python tools/plan_step.py --recipe recipes/stem_1b.yaml --baseline recipes/dense_1b.yaml \\
        --nodes 4 --gpus-per-node 8 --hardware h200 [--choose best] [--details] [overrides]

Any recipe, with `section.field=value` overrides. A STEM recipe's tables can train in
several ways (placement/update/partition/overlap/optimizer): `--choose` names the one the
last line reports. A dense recipe (or a STEM one without `--baseline`) is planned alone.
The printout is a summary (each recipe's step, MFU and memory per GPU, the best table
option); `--details` adds every component's bytes/FLOPs/elements and seconds, every table
option ranked and the memory's parts (planning/memory.py). The last line is
`predicted step time STEM <s> s, dense <s> s, ratio <r>` (with a baseline) or
`predicted step time <s> s, MFU <m>`. Hardware: h100, h200 (published numbers, or a refit
from bench/gpu/run_all.sh), cpu (this machine, as `python -m megatron_stem.planning.calibrate`
measured it; --calibrate measures it first, 3-4 minutes with progress). See docs/tables.md.
"""

import argparse
import dataclasses
import sys

from megatron_stem.config import load_recipe
from megatron_stem.planning import hardware, memory, report, rows, step
from megatron_stem.runtime.errors import UserError, cli

CHOICES = "recipe, best, best-any, or placement/update/partition/overlap/optimizer"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--recipe", required=True, help="the recipe to plan (STEM or dense)")
    ap.add_argument("--baseline", help="a recipe to compare it with, e.g. its dense baseline")
    ap.add_argument("--nodes", type=int, default=1, help="(default: %(default)s)")
    ap.add_argument("--gpus-per-node", type=int, default=8, help="(default: %(default)s)")
    ap.add_argument("--hardware", default="h200",
                    help=f"one of {', '.join(hardware.NAMES)} (default: %(default)s)")
    ap.add_argument("--calibrate", action="store_true",
                    help="measure the cpu profile first (3-4 minutes, with progress)")
    ap.add_argument("--profile", help="a profile JSON to use instead (calibrate.py --out)")
    ap.add_argument("--choose", default="recipe",
                    help=f"the table option of a STEM recipe the last line reports: {CHOICES} "
                         "(recipe: what it trains with; best: the fastest exact option with "
                         "the tables' optimizer states in CPU memory; best-any: on the GPUs "
                         "too; e.g. host/dense/sharded/none/cpu) (default: %(default)s)")
    ap.add_argument("--details", action="store_true",
                    help="also every component, every table option ranked, and the parts of "
                         "the memory per GPU")
    ap.add_argument("--zipf", type=float, default=rows.ZIPF_EXPONENT,
                    help="exponent of the distinct-ids model (default: %(default)s)")
    ap.add_argument("--rank-rows", type=int, help="distinct rows per rank per step")
    ap.add_argument("--union-rows", type=int, help="distinct rows over DP per step")
    ap.add_argument("--microbatch-rows", type=int,
                    help="distinct rows summed over a rank's micro-batches")
    ap.add_argument("--owner-skew", type=float, default=1.0,
                    help="busiest owner's received rows / mean in the grads all-to-all "
                         "(1: rows dealt round-robin; ~3: contiguous ranges of a BPE vocab) "
                         "(default: %(default)s)")
    ap.add_argument("--host-memory-gb", type=float, default=None,
                    help="CPU memory per node (default: 2048 for GPU nodes, this machine's)")
    ap.add_argument("overrides", nargs="*", help="recipe overrides section.field=value")
    return ap.parse_args(argv)


def _host_memory(args, hw) -> float:
    if args.host_memory_gb is not None:
        return args.host_memory_gb * 1e9
    if hw.device_is_host:
        from megatron_stem.tables.host_memory import available_host_bytes  # noqa: PLC0415

        return float(available_host_bytes() or 0)
    return 2048e9  # DGX H100/H200: 2 TB


def _chosen(args, plans: list, configured) -> "step.Plan":
    if args.choose == "recipe":
        return configured
    if args.choose in ("best", "best-any"):
        return step.best(plans, "cpu" if args.choose == "best" else "any")
    option = step.Option.parse(args.choose)
    return next(p for p in plans if p.option == option)


def _summary(title: str, p, mem: memory.MemoryPlan) -> str:
    fits = "fits" if mem.fits else "DOES NOT FIT"
    return (f"{title}: step {p.step_s:.4f} s, MFU {p.mfu:.1%}; memory per GPU "
            f"{mem.total() / 1e9:.1f} GB of {mem.capacity / 1e9:.0f}: {fits}")


@cli
def main(argv=None) -> int:
    args = parse_args(argv)
    if args.nodes < 1 or args.gpus_per_node < 1:
        raise UserError("--nodes and --gpus-per-node must be >= 1")
    if args.calibrate:
        if args.hardware != "cpu" or args.profile:
            raise UserError("--calibrate measures the cpu profile: use it with --hardware cpu")
        from megatron_stem.planning import calibrate  # noqa: PLC0415

        calibrate.measure_and_save()
    hw = hardware.read(args.profile) if args.profile else hardware.load(args.hardware)
    recipe = load_recipe(args.recipe, args.overrides)
    baseline = load_recipe(args.baseline) if args.baseline else None
    if not recipe.model.is_stem and args.choose != "recipe":
        raise UserError(f"--choose: {args.recipe} has no STEM tables to choose an option for")
    cluster = step.Cluster(args.nodes, args.gpus_per_node)
    host_memory = _host_memory(args, hw)
    override = {"rank_rows": args.rank_rows, "union_rows": args.union_rows,
                "microbatch_rows": args.microbatch_rows}
    w = dataclasses.replace(step.workload(recipe, cluster, args.zipf, override,
                                          name=args.recipe), owner_skew=args.owner_skew)

    def memory_of(r, title, rank_rows=None):
        return memory.memory_per_gpu(r, cluster, hw, args.zipf, rank_rows,
                                     title=f"memory per GPU (predicted: counts x bytes), {title}")

    out = [f"step plan: {args.recipe}" + (f" against {args.baseline}" if baseline else "") +
           f" on {args.nodes} x {args.gpus_per_node} {hw.name} (TP{w.tp}, DP{w.dp})",
           report.workload_line(w, args.zipf), ""]
    details, summary = [], []
    base = None
    if baseline is not None:
        wb = step.workload(baseline, cluster, args.zipf, name=args.baseline)
        base = step.plan(wb, step.configured_option(baseline) if baseline.model.is_stem
                         else None, cluster, hw, host_memory)
        base_memory = memory_of(baseline, f"baseline ({args.baseline})")
        summary.append(_summary(f"baseline ({args.baseline})", base, base_memory))
        details += report.components(f"baseline ({args.baseline})", base) + [""]
    if recipe.model.is_stem:
        plans = step.rank(w, cluster, hw, host_memory)
        best = step.best(plans, "cpu")
        configured = next(p for p in plans if p.option == step.configured_option(recipe))
        chosen = _chosen(args, plans, configured)
        mem = memory_of(recipe, f"STEM as the recipe trains it ({args.recipe}: "
                                f"{configured.option})", args.rank_rows)
        summary += [_summary(f"STEM as the recipe trains it ({configured.option})",
                             configured, mem),
                    f"best table option (--choose best): {best.option}, step "
                    f"{best.step_s:.4f} s"]
        seen = []
        for title, p in (("configured by the recipe", configured),
                         ("best (--choose best)", best), ("chosen", chosen)):
            if p not in seen:
                seen.append(p)
                details += report.components(f"STEM, {title}: {p.option}", p) + [""]
        if base is not None:
            details += report.ranking(plans, base, best) + [""]
        summary.append(f"choice: {args.choose} = {chosen.option}")
    else:
        chosen = step.plan(w, None, cluster, hw, host_memory)
        mem = memory_of(recipe, f"{args.recipe}")
        summary.append(_summary(args.recipe, chosen, mem))
        details += report.components(args.recipe, chosen) + [""]
    if args.details:
        out += details
        if baseline is not None:
            out += memory.report(base_memory) + [""]
        out += memory.report(mem) + [""]
    out += summary
    if base is None:
        out.append(f"predicted step time {chosen.step_s:.3f} s, MFU {chosen.mfu:.1%}")
    elif recipe.model.is_stem:
        out.append(report.verdict(chosen, base))
    else:
        out.append(f"predicted step time {chosen.step_s:.3f} s, baseline {base.step_s:.3f} s, "
                   f"ratio {chosen.step_s / base.step_s:.2f}")
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
