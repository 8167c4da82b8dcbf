"""The collectives a recipe's step runs, at its sizes, measured on the job's ranks against
what the step planner prices them at (the acceptance run's collectives stage,
docs/acceptance.md).

    torchrun ... -m megatron_stem.planning.collectives --recipe R [overrides] \
        --hardware h100 --out collectives.json

Sizes are the planner's for the recipe on the job's nodes x GPUs (`sizes`): one bucket of
the backbone's gradient all-reduce (`backbone.reduce_bucket_elements`, fp32), the tables'
gradients sent to their owners (one all-to-all of `traffic.grads_to_owners_bytes`) and one
table's updated rows all-gathered (`traffic.gather_bytes` over the tables). Each runs over
the ranks of one node (NVLink on a GPU node) and over every rank (across the nodes'
network), where that group has more than one rank and differs from the other: the
median of `--repeat` calls after two warm-up calls, each started together (a barrier) and
timed to its end on the device, the slowest rank's. The prediction is the planner's
(`hardware.Hardware`'s ring bus bandwidth, all-to-all and all-gather formulas, plus one
call's latency). Rank 0 writes every measurement with its prediction and bus bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_stem.config import Recipe
from megatron_stem.planning import traffic
from megatron_stem.planning.backbone import COMM_BYTES, reduce_bucket_elements
from megatron_stem.planning.hardware import Hardware
from megatron_stem.planning.step import configured_option, layout_of, rows_for
from megatron_stem.planning.workload import Cluster, workload
from megatron_stem.runtime.errors import UserError, cli

KINDS = ("all_reduce", "all_to_all", "all_gather")


@dataclass(frozen=True)
class Collective:
    """One collective of the step: `nbytes` is what a rank reduces (all-reduce), sends
    (all-to-all) or receives (all-gather)."""

    kind: str
    what: str
    nbytes: float


def sizes(recipe: Recipe, cluster: Cluster, hw: Hardware) -> list[Collective]:
    """The step's collectives of the module docstring, at the recipe's sizes."""
    w = workload(recipe, cluster)
    bucket = reduce_bucket_elements(recipe.model, w.tp, w.dp)
    out = [Collective("all_reduce", f"backbone gradient bucket ({bucket / 1e6:.1f}M fp32)",
                      bucket * COMM_BYTES)]
    if not w.shape.tables:
        return out
    lay = layout_of(w, configured_option(recipe), cluster, hw)
    counts = rows_for(w.rows, lay)
    sent = traffic.grads_to_owners_bytes(w.shape, lay, counts)
    if sent:
        out.append(Collective("all_to_all", "tables' gradients to their owners", sent))
    gathered = traffic.gather_bytes(w.shape, lay, counts) / w.shape.tables
    if gathered:
        out.append(Collective("all_gather", "one table's updated rows", gathered))
    return out


def predicted_seconds(c: Collective, ranks: int, per_node: int, hw: Hardware) -> float:
    """The planner's price of `c` over `ranks` ranks, `per_node` of them per node."""
    if ranks <= 1:
        return 0.0
    if c.kind == "all_reduce":
        seconds = hw.ring_seconds(c.nbytes, ranks, per_node)
    elif c.kind == "all_to_all":
        seconds = hw.alltoall_seconds(c.nbytes, ranks, per_node)
    else:
        seconds = hw.allgather_seconds(c.nbytes, ranks, per_node)
    return seconds + hw.collective_latency


def bus_bandwidth(c: Collective, ranks: int, seconds: float) -> float:
    """Bytes per second as NCCL's tests count them: an all-reduce's bus bandwidth
    (2 (n-1)/n x bytes), an all-to-all's bytes sent to others, an all-gather's received."""
    moved = 2 * c.nbytes * (ranks - 1) / ranks if c.kind == "all_reduce" else c.nbytes
    return moved / seconds if seconds > 0 else 0.0


def groups(world: int, per_node: int) -> list[tuple[str, int]]:
    """(scope, ranks) of the groups to measure: a node's ranks and every rank, each when it
    has more than one rank and is not the other."""
    out = []
    if per_node > 1:
        out.append(("node", per_node))
    if world > per_node:
        out.append(("world", world))
    return out


def _measure(c: Collective, group, repeat: int) -> float:
    """The median seconds of `c` on `group` (this rank's; the caller takes the slowest)."""
    import torch
    import torch.distributed as dist

    from megatron_stem.runtime.parallel import device

    ranks = dist.get_world_size(group)
    dev = device()
    elements = max(1, int(c.nbytes) // 4)
    if c.kind == "all_reduce":
        x = torch.ones(elements, device=dev)

        def call():
            dist.all_reduce(x, group=group)
    elif c.kind == "all_to_all":
        per_peer = max(1, elements // max(ranks - 1, 1))
        send = torch.ones(per_peer * ranks, device=dev)
        received = torch.empty_like(send)

        def call():
            dist.all_to_all_single(received, send, group=group)
    else:
        per_peer = max(1, elements // max(ranks - 1, 1))
        shard = torch.ones(per_peer, device=dev)
        parts = [torch.empty_like(shard) for _ in range(ranks)]

        def call():
            dist.all_gather(parts, shard, group=group)

    def timed():
        dist.barrier(group=group)
        began = time.perf_counter()
        call()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - began

    for _ in range(2):
        timed()
    return statistics.median(timed() for _ in range(repeat))


def measure(recipe: Recipe, hw: Hardware, repeat: int) -> dict:
    """Every collective of `sizes` on every group of `groups`, on this job's ranks (a
    collective call: every rank runs it); rank 0's result has them all."""
    import torch
    import torch.distributed as dist

    from megatron_stem.runtime.parallel import device

    world = dist.get_world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cluster = Cluster(world // per_node, per_node)
    nodes = [dist.new_group(list(range(n * per_node, (n + 1) * per_node)))
             for n in range(cluster.nodes)]  # every rank makes every group
    mine = nodes[dist.get_rank() // per_node]
    found = []
    for c in sizes(recipe, cluster, hw):
        for scope, ranks in groups(world, per_node):
            group = mine if scope == "node" else None
            seconds = torch.tensor([_measure(c, group, repeat)], dtype=torch.float64,
                                   device=device())
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            measured = seconds.item()
            found.append({"kind": c.kind, "what": c.what, "scope": scope, "ranks": ranks,
                          "bytes": c.nbytes, "seconds": measured,
                          "predicted_s": predicted_seconds(c, ranks, min(ranks, per_node), hw),
                          "busbw": bus_bandwidth(c, ranks, measured)})
    return {"nodes": cluster.nodes, "gpus_per_node": per_node, "hardware": hw.name,
            "collectives": found}


@cli
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--hardware", required=True,
                    help="the profile whose constants predict them (a name, a file, or "
                         "auto: this node's GPU's)")
    ap.add_argument("--repeat", type=int, default=10, help="(default: %(default)s)")
    ap.add_argument("--out", required=True, help="where rank 0 writes them (JSON)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    from megatron_stem.config import ParallelConfig, load_recipe
    from megatron_stem.planning import hardware
    from megatron_stem.runtime.parallel import destroy_distributed, init_distributed

    recipe = load_recipe(args.recipe, args.overrides)
    hw = hardware.load_detected(args.hardware)
    if args.repeat < 1:
        raise UserError(f"--repeat: must be >= 1, got {args.repeat}")
    init_distributed(ParallelConfig())
    try:
        import torch.distributed as dist

        result = measure(recipe, hw, args.repeat)
        if dist.get_rank() == 0:
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
            for c in result["collectives"]:
                print(f"{c['kind']} {c['what']} over {c['ranks']} ranks ({c['scope']}): "
                      f"{c['seconds'] * 1e3:.3f} ms, predicted {c['predicted_s'] * 1e3:.3f} ms",
                      flush=True)
            if not result["collectives"]:
                print("one rank: no collective to measure", flush=True)
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
