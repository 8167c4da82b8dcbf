"""Predict a STEM recipe's step time against its dense baseline on a cluster.

    python tools/plan_step.py --recipe recipes/stem_1b.yaml --baseline recipes/dense_1b.yaml \\
        --nodes 4 --gpus-per-node 8 --hardware h200 [--choose recipe|best|best-any|P/U/S/O/D]

Prints, per rank per step, every component's bytes/FLOPs/elements and seconds for the
dense baseline, the recipe's configured table option and the best one, then every option
ranked, then the memory per GPU of both recipes as configured (parameters, gradients,
optimizer states, tables, activations; planning/memory.py), and ends with `predicted step time STEM <s> s, dense <s> s, ratio <r>` for the
option `--choose` names: `recipe` (default: what the recipe trains with), `best` (the
fastest exact option with the tables' optimizer states in CPU memory), `best-any` (GPU
states may compete), or an explicit placement/update/partition/overlap/optimizer.
Hardware: h100, h200 (published numbers, or a refit from bench/gpu/run_all.sh), cpu (this
machine, as `python -m megatron_stem.planning.calibrate` measured it; --calibrate measures it
first, 3-4 minutes with progress). See docs/tables.md.
"""

import argparse
import dataclasses
import sys

from megatron_stem.config import load_recipe
from megatron_stem.runtime.errors import UserError, cli
from megatron_stem.planning import hardware, memory, report, rows, step


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", required=True, help="the STEM recipe")
    ap.add_argument("--baseline", required=True, help="its dense baseline recipe")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--hardware", default="h200", help=f"one of {', '.join(hardware.NAMES)}")
    ap.add_argument("--calibrate", action="store_true",
                    help="measure the cpu profile first (3-4 minutes, with progress)")
    ap.add_argument("--profile", help="a profile JSON to use instead (calibrate.py --out)")
    ap.add_argument("--choose", default="recipe")
    ap.add_argument("--zipf", type=float, default=rows.ZIPF_EXPONENT,
                    help="exponent of the distinct-ids model")
    ap.add_argument("--rank-rows", type=int, help="distinct rows per rank per step")
    ap.add_argument("--union-rows", type=int, help="distinct rows over DP per step")
    ap.add_argument("--microbatch-rows", type=int,
                    help="distinct rows summed over a rank's micro-batches")
    ap.add_argument("--owner-skew", type=float, default=1.0,
                    help="busiest owner's received rows / mean in the grads all-to-all "
                         "(1: rows dealt round-robin; ~3: contiguous ranges of a BPE vocab)")
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
    stem_recipe = load_recipe(args.recipe, args.overrides)
    dense_recipe = load_recipe(args.baseline)
    if not stem_recipe.model.is_stem:
        raise UserError(f"--recipe {args.recipe}: has no STEM layers (model.stem_layers)")
    cluster = step.Cluster(args.nodes, args.gpus_per_node)
    override = {"rank_rows": args.rank_rows, "union_rows": args.union_rows,
                "microbatch_rows": args.microbatch_rows}
    w = dataclasses.replace(step.workload(stem_recipe, cluster, args.zipf, override,
                                          name=args.recipe), owner_skew=args.owner_skew)
    wd = step.workload(dense_recipe, cluster, args.zipf, name=args.baseline)
    host_memory = _host_memory(args, hw)
    dense = step.plan(wd, None, cluster, hw, host_memory)
    plans = step.rank(w, cluster, hw, host_memory)
    best = step.best(plans, "cpu")
    configured = next(p for p in plans if p.option == step.configured_option(stem_recipe))
    chosen = {"recipe": configured, "best": best,
              "best-any": None}.get(args.choose)
    if args.choose == "best-any":
        chosen = step.best(plans, "any")
    elif chosen is None:
        option = step.Option.parse(args.choose)
        chosen = next(p for p in plans if p.option == option)

    out = [f"STEM step plan: {args.recipe} against {args.baseline} on {args.nodes} x "
           f"{args.gpus_per_node} {hw.name} (TP{w.tp}, DP{w.dp})",
           report.workload_line(w, args.zipf), ""]
    out += report.components(f"dense baseline ({args.baseline})", dense) + [""]
    shown = [("configured by the recipe", configured), ("best (--choose best)", best)]
    if chosen not in (configured, best):
        shown.append(("chosen", chosen))
    seen = []
    for title, p in shown:
        if p in seen:
            continue
        seen.append(p)
        out += report.components(f"STEM, {title}: {p.option}", p) + [""]
    out += report.ranking(plans, dense, best) + [""]
    for title, recipe, rank_rows in (
            (f"dense baseline ({args.baseline})", dense_recipe, None),
            (f"STEM as the recipe trains it ({args.recipe}: {configured.option})",
             stem_recipe, args.rank_rows)):
        out += memory.report(memory.memory_per_gpu(
            recipe, cluster, hw, args.zipf, rank_rows,
            title=f"memory per GPU (predicted: counts x bytes), {title}")) + [""]
    out.append(f"choice: {args.choose} = {chosen.option}")
    out.append(report.verdict(chosen, dense))
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
