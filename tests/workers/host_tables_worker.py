"""Host tables over two data-parallel ranks, against device-resident tables.

    torchrun --nproc_per_node 2 host_tables_worker.py OUT.json KERNEL

Each rank trains two tables on its own ids for a few steps (two micro-batches per step,
clipping, a cache) with: device-resident tables (sparse grads, all-reduce), one host copy
shared by both ranks (row owners), and one host copy per rank (the cross-copy path), each
with the optimizer state replicated (per rank / per copy) and sharded over the two ranks,
with the table kernel KERNEL (deepspeed or torch).
"""

import glob
import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import HostTable
from megatron_stem.config import ParallelConfig
from megatron_stem.model.host_copy import SHM_DIR, HostCopy
from megatron_stem.runtime.parallel import destroy_distributed, init_distributed
from megatron_stem.tables.host_tables import HostTableStore
from megatron_stem.config.table_layout import TableLayout
from megatron_stem.tables.optimizer import TableOptimizer

VOCAB, WIDTH, STEPS = 98, 8, 4
CASES = {"device_sharded": ("device", "sharded", 0),
         "shared": ("host", "replicated", 0), "per_rank": ("host", "replicated", 1),
         "shared_sharded": ("host", "sharded", 0), "per_rank_sharded": ("host", "sharded", 1)}


def full_states(opt: TableOptimizer, params) -> dict[str, torch.Tensor]:
    """Every table and its whole optimizer state, [tables, V, w] each (a sharded
    optimizer's shards gathered from the two ranks)."""
    states = {k: torch.stack([s[k] for s in opt.state_tensors().values()])
              for k in ("fp32_param", "exp_avg", "exp_avg_sq")}
    if opt.shard() is not None:
        for k, shard in states.items():
            full = torch.empty(shard.shape[0], VOCAB, WIDTH)
            dist.all_gather(list(full.chunk(dist.get_world_size(), dim=1)), shard)
            states[k] = full
    states["table"] = torch.stack([p.detach() for p in params])
    return states


def train(kernel: str, update: str, placement: str, partition: str = "replicated",
          ranks_per_copy: int = 0):
    init = torch.randn(2, VOCAB, WIDTH, generator=torch.Generator().manual_seed(7))
    store, copy, owners_ok = None, None, True
    if placement == "host":
        copy = HostCopy(ranks_per_copy)
        tables = [HostTable(copy.tensor(f"t{i}", (VOCAB, WIDTH),
                                        init=lambda t, i=i: t.copy_(init[i])))
                  for i in range(2)]
        for t in tables:
            t.host_copy = copy
        store = HostTableStore(tables, torch.device("cpu"), torch.float32, cache_rows=16)
        params = [t.weight for t in tables]
    else:
        params = [torch.nn.Parameter(init[i].clone()) for i in range(2)]
    layout = TableLayout(placement, partition, update, kernel=kernel)
    opt = TableOptimizer([(f"t{i}", p) for i, p in enumerate(params)], layout, 1.0, 0.1,
                         (0.9, 0.95), host=store)
    part = opt.partition
    owners = getattr(part, "shards", None) or getattr(part, "owners", None)
    g = torch.Generator().manual_seed(100 + dist.get_rank())  # each rank its own ids
    norms = []
    for _ in range(STEPS):
        mbs = [{"tokens": torch.randint(0, VOCAB - 30, (2, 6), generator=g)}  # rows 68+ unseen
               for _ in range(2)]
        opt.stage(mbs)
        for mb in mbs:
            for i, p in enumerate(params):
                if store is not None:
                    inverse, rows = store.lookup(mb["tokens"], tables[i])
                    out = F.embedding(inverse, rows, sparse=True)
                else:
                    out = F.embedding(mb["tokens"], p, sparse=True)
                (out.sin() * (i + 1)).sum().backward()
        opt.sync_grads()
        if owners is not None and owners.size > 1:  # each rank holds only the rows it owns
            for t in opt.tables:
                owners_ok &= bool((owners.owner_of(part.ids_of(t.rows)) == owners.rank).all())
        norms.append(opt.grad_norm_sq())
        opt.step(1e-2, clip_coef=0.7)
    states = full_states(opt, params)
    opt.close()
    return states, torch.tensor(norms, dtype=torch.float64), copy, owners_ok


def main():
    init_distributed(ParallelConfig())
    rank = dist.get_rank()
    result = {"max_diff": {}, "owners_disjoint": True}
    for update in ("lazy", "dense"):
        reference, ref_norms, _, _ = train(sys.argv[2], update, "device")
        for name, (placement, partition, per_copy) in CASES.items():
            states, norms, copy, owners_ok = train(sys.argv[2], update, placement, partition,
                                                   per_copy)
            result["owners_disjoint"] &= owners_ok
            if copy is not None:
                result.setdefault("copy_sizes", {})[name] = copy.size
            result["max_diff"][f"{update}/{name}"] = max(
                float((states[k] - reference[k]).abs().max()) for k in states)
            result.setdefault("norm_rel_diff", {})[f"{update}/{name}"] = float(
                ((norms - ref_norms).abs() / ref_norms).max())
    # The shared copy really is one memory: a write on rank 1 is read on rank 0.
    copy = HostCopy(0)
    marker = copy.tensor("marker", (4,))
    if rank == 1:
        marker[2] = 42.0
    copy.barrier()
    result["shared_memory_seen"] = bool(marker[2] == 42.0)
    result["leftover_shm_files"] = glob.glob(f"{SHM_DIR}/megatron_stem_{copy.key}*")
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if rank == 0:
        merged = gathered[0]
        merged["owners_disjoint"] = all(r["owners_disjoint"] for r in gathered)
        merged["shared_memory_seen"] = all(r["shared_memory_seen"] for r in gathered)
        for r in gathered[1:]:
            for k, v in r["max_diff"].items():
                merged["max_diff"][k] = max(merged["max_diff"][k], v)
                merged["norm_rel_diff"][k] = max(merged["norm_rel_diff"][k],
                                                 r["norm_rel_diff"][k])
        with open(sys.argv[1], "w") as f:
            json.dump(merged, f)
    destroy_distributed()


if __name__ == "__main__":
    main()
