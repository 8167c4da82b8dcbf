"""The table path's counters against the step planner's predictions, on two ranks.

    torchrun --nproc_per_node 2 traffic_worker.py OUT.json

For each layout, a step of two device tables over each rank's own ids: the trainer's
`TableOptimizer.stats()` (what it moved) and `planning.traffic.counters` on the row counts
the step really had.
"""

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_stem.config import ParallelConfig
from megatron_stem.runtime.parallel import destroy_distributed, init_distributed
from megatron_stem.planning import traffic
from megatron_stem.config.table_layout import TableLayout
from megatron_stem.tables.optimizer import TableOptimizer
from megatron_stem.tables.shards import interleaved_order

VOCAB, WIDTH, TABLES = 64, 8, 2
# (`next_step`'s padded gathers, one per stage, are modelled from one longest owner, not per
# stage.)
LAYOUTS = [("dense", "sharded", "none"), ("lazy", "sharded", "none"),
           ("dense", "replicated", "none"), ("lazy", "replicated", "none")]


def measured_counts(ids: torch.Tensor) -> traffic.RowCounts:
    """This step's distinct rows as the planner's RowCounts, from every rank's ids."""
    world, rank = dist.get_world_size(), dist.get_rank()
    everyone = [None] * world
    dist.all_gather_object(everyone, ids.unique().tolist())
    mine = set(everyone[rank])
    union = set().union(*map(set, everyone))
    per = VOCAB // world
    shard = {int(r): k // per for k, r in enumerate(interleaved_order(VOCAB))}  # row -> owner
    owned = [{r for r in union if shard[r] == k} for k in range(world)]
    return traffic.RowCounts(
        rank_rows=len(mine), union_rows=len(union), owned_rows=len(owned[rank]),
        microbatch_rows=len(mine), longest_rank_rows=max(len(e) for e in everyone),
        self_rows=sum(1 for r in mine if shard[r] == rank),
        longest_owned_rows=max(len(o) for o in owned))


def step(update: str, partition: str, overlap: str, ids: torch.Tensor) -> dict:
    """One step's counters; `next_step` is given this step's ids as the next step's."""
    params = [torch.nn.Parameter(torch.randn(VOCAB, WIDTH)) for _ in range(TABLES)]
    layout = TableLayout(partition=partition, update=update, overlap=overlap, kernel="torch")
    opt = TableOptimizer([(f"t{i}", p) for i, p in enumerate(params)], layout, 1.0, 0.1,
                         (0.9, 0.95))
    for p in params:
        F.embedding(ids, p, sparse=True).sum().backward()
    opt.sync_grads()
    opt.step(1e-2, next_ids=[ids] if overlap == "next_step" else None)
    stats = opt.stats()  # waits for an overlapped update
    opt.close()
    return stats


def main():
    init_distributed(ParallelConfig())
    g = torch.Generator().manual_seed(10 + dist.get_rank())
    ids = torch.randint(0, VOCAB, (3, 7), generator=g)  # each rank its own ids
    counts = measured_counts(ids)
    shape = traffic.TableShape(tables=TABLES, rows=VOCAB, width=WIDTH)
    result = {}
    for update, partition, overlap in LAYOUTS:
        layout = traffic.Layout(placement="device", update=update, partition=partition,
                                optimizer="cpu", dp=dist.get_world_size(), ranks_per_copy=1,
                                grad_bytes=4, param_bytes=4, device_is_host=True,
                                overlap=overlap)
        predicted = traffic.counters(shape, layout, counts)
        result[f"{update}/{partition}/{overlap}/rank{dist.get_rank()}"] = {
            "measured": step(update, partition, overlap, ids),
            "predicted": {k.removeprefix("tables/"): v for k, v in predicted.items()}}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump({k: v for r in gathered for k, v in r.items()}, f)
    destroy_distributed()


if __name__ == "__main__":
    main()
