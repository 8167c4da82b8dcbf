"""Forward/backward of a tiny model on one parallel layout; dumps loss, grads, logits.

    torchrun --nproc_per_node N parity.py --out DIR [--tp 2] [--pp 2] [--sp]
             [--recompute] [--load CKPT] [--save CKPT] [--stem 1/2] [--seed N] [--tied]
             [--documents] [--init truncated_fan_in] [--load-dense ITER_DIR]
             [--loss-chunk N] [--loss-mask] [--recompute-modules a,b]

`--documents`: micro-batches cut into documents, with reset positions and attention kept
inside each document (model/documents.py). `--loss-chunk N`: the loss in chunks of N
positions (model/loss.py); `--loss-mask`: some positions out of the loss (`loss_masked`; the dump counts
the chunk function's calls in forward and backward, `chunk_loss_calls`);
`--recompute-modules`: selective recompute of these modules.
"""

# megatron_stem before megatron-core: its import hook keeps megatron-core from importing
# TorchDynamo and Inductor (megatron_stem/runtime/lazy_imports.py), seconds of every rank's start.
import megatron_stem  # noqa: F401

# isort: split
import argparse
import os
from pathlib import Path

import torch
from megatron.core import dist_checkpointing
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from common import ChunkLossCalls, full_named, loss_masked, microbatches, tiny_model
from megatron_stem import checkpoint
from megatron_stem.config import ParallelConfig
from megatron_stem.model import build_model
from megatron_stem.runtime.parallel import destroy_distributed, init_distributed
from megatron_stem.training.batches import model_inputs
from schedule import forward_backward


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--sp", action="store_true")
    ap.add_argument("--recompute", action="store_true")
    ap.add_argument("--stem", default="1/2")
    ap.add_argument("--load")
    ap.add_argument("--save")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--tied", action="store_true", help="tie input and output embeddings")
    ap.add_argument("--documents", action="store_true")
    ap.add_argument("--init", default="megatron", help="model.init")
    ap.add_argument("--load-dense", help="a dense checkpoint (iter_N) to start STEM from")
    ap.add_argument("--loss-chunk", type=int, default=0)
    ap.add_argument("--loss-mask", action="store_true")
    ap.add_argument("--recompute-modules", default="")
    args = ap.parse_args()

    parallel = ParallelConfig(tensor_parallel=args.tp, pipeline_parallel=args.pp,
                              sequence_parallel=args.sp,
                              recompute="full" if args.recompute else
                              "selective" if args.recompute_modules else "none",
                              recompute_modules=[m for m in args.recompute_modules.split(",")
                                                 if m],
                              loss_chunk_tokens=args.loss_chunk)
    init_distributed(parallel, seed=args.seed)
    cfg = tiny_model(args.stem, untie_embeddings=not args.tied, init=args.init)
    model = build_model(cfg, parallel, seed=args.seed)
    if args.load:
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), args.load))
    if args.load_dense:
        checkpoint.load_model(model, Path(args.load_dense), dense_source=True)

    batches = microbatches(cfg, documents=args.documents)
    if args.loss_mask:
        batches = loss_masked(batches)
    result = {"params": full_named(model, model.config, "param")}
    if args.pp == 1:
        model.eval()
        with torch.no_grad():
            logits = model(batches[0]["tokens"], **model_inputs(batches[0]))
        result["logits"] = gather_from_tensor_model_parallel_region(logits)
        model.train()
    chunk_calls = ChunkLossCalls()
    result["loss"] = forward_backward(model, batches)
    result["chunk_loss_calls"] = chunk_calls.close()
    result["grads"] = full_named(model, model.config, "grad")

    if args.save:
        dist_checkpointing.save(model.sharded_state_dict(), args.save)
    rank = torch.distributed.get_rank()
    torch.save(result, os.path.join(args.out, f"rank{rank}.pt"))
    destroy_distributed()


if __name__ == "__main__":
    main()
