"""Which threads use the overlapped update's process group, on two ranks.

    torchrun --nproc_per_node 2 overlap_worker.py OUT.json

NCCL creates a communicator at a group's first collective, collectively: made lazily while
another thread runs other collectives, ranks can deadlock; and a group's collectives
issued from a second thread interleave with the main thread's differently on each rank.
So the group is used on the main thread only, first at construction.
"""

import json
import sys
import threading

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_stem.config import ParallelConfig
from megatron_stem.runtime.parallel import destroy_distributed, init_distributed
from megatron_stem.config.table_layout import TableLayout
from megatron_stem.tables.optimizer import TableOptimizer

USES = []  # (thread name, group) of every collective


def logged(collective):
    def run(*args, group=None, **kwargs):
        USES.append((threading.current_thread().name, group))
        return collective(*args, group=group, **kwargs)
    return run


def main():
    init_distributed(ParallelConfig())
    for name in ("all_reduce", "all_gather", "all_to_all_single", "reduce"):
        setattr(dist, name, logged(getattr(dist, name)))
    table = torch.nn.Parameter(torch.randn(64, 8))
    opt = TableOptimizer([("t", table)], TableLayout(overlap="next_step", kernel="torch"), 1.0,
                         0.1, (0.9, 0.95))
    group = opt.overlap.comm.group
    made = [thread for thread, g in USES if g is group]
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(dist.get_rank()))
    F.embedding(ids, table, sparse=True).sum().backward()
    opt.sync_grads()
    opt.step(1e-2, next_ids=[ids])
    opt.finish()
    used = [thread for thread, g in USES if g is group]
    opt.close()
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump({"at_construction": made, "all": used}, f)
    destroy_distributed()


if __name__ == "__main__":
    main()
