"""Logits of checkpoints loaded at TP=1, TP=2 and PP=2 (run on 2 ranks).

    torchrun --nproc_per_node 2 hf_layouts.py --out FILE --load NAME=CKPT [...]

Each checkpoint (an HF import, or a run trained from one) is built from its own recipe at
each layout, loaded, and run on `common.hf_tokens()`; tied embeddings skip PP=2 (on CPU
megatron-core cannot tie across stages: it moves the shared embedding with `.cuda()`).
Rank 0 writes FILE: {"tokens": ..., "NAME@tp1": logits, ...} (full padded vocab).
"""

# megatron_stem before megatron-core: its import hook keeps megatron-core from importing
# TorchDynamo and Inductor (megatron_stem/runtime/lazy_imports.py), seconds of every rank's start.
import megatron_stem  # noqa: F401

# isort: split
import argparse

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from common import hf_tokens
from hf_reference import loaded_logits
from megatron_stem.config import ParallelConfig
from megatron_stem.runtime.parallel import destroy_distributed, init_distributed

LAYOUTS = {"tp1": ParallelConfig(), "tp2": ParallelConfig(tensor_parallel=2),
           "pp2": ParallelConfig(pipeline_parallel=2)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--load", nargs="+", required=True)
    args = ap.parse_args()
    ids = hf_tokens()
    results = {"tokens": ids}
    for layout, parallel in LAYOUTS.items():
        init_distributed(parallel, seed=1234)
        results.update(loaded_logits(args.load, layout, parallel, ids))
        parallel_state.destroy_model_parallel()
    if dist.get_rank() == 0:
        torch.save(results, args.out)
    destroy_distributed()


if __name__ == "__main__":
    main()
