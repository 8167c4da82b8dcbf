"""Megatron side of the Hugging Face tests, at TP=2 and then PP=2 (run on 2 ranks).

    torchrun --nproc_per_node 2 hf_reference.py --out DIR [--load NAME=CKPT ...]

For each layout and model kind it builds a seeded tiny model, saves it with
`checkpoint.Writer` under DIR/<kind>_<layout>, and records the full-vocab logits of fixed
tokens and its greedy continuation of a prompt. Each `--load` checkpoint (an HF import)
is loaded at both layouts (tied ones at TP=2 only) and its logits recorded. Rank 0 writes
DIR/reference.pt.

Greedy decoding takes the argmax over real token ids only (< vocab_size): the vocab
padding columns megatron adds for TP are not tokens.
"""

# megatron_stem before megatron-core: its import hook keeps megatron-core from importing
# TorchDynamo and Inductor (megatron_stem/runtime/lazy_imports.py), seconds of every rank's start.
import megatron_stem  # noqa: F401

# isort: split
import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from common import TINY, hf_tokens
from megatron_stem import checkpoint
from megatron_stem.config import ModelConfig, ParallelConfig, Recipe
from megatron_stem.model import build_model
from megatron_stem.runtime.parallel import destroy_distributed, init_distributed

LAYOUTS = {"tp2": ParallelConfig(tensor_parallel=2), "pp2": ParallelConfig(pipeline_parallel=2)}
# Dense uses tied embeddings at TP=2 (megatron-core cannot tie across pipeline stages on
# CPU: it moves the shared embedding with `.cuda()`), untied at PP=2.
KINDS = {"stem": dict(stem_layers="1/2"), "dense": dict(stem_layers="none")}
TIED = {("dense", "tp2")}
PROMPT_LEN, NEW_TOKENS = 6, 10


@torch.no_grad()
def full_logits(model, ids: torch.Tensor, padded_vocab: int) -> torch.Tensor:
    """[b, s, padded vocab] logits on every rank, for any TP/PP layout."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return gather_from_tensor_model_parallel_region(model(ids, None, None))
    b, s = ids.shape

    def step(data_iterator, model):
        return model(next(data_iterator), None, None), None  # no loss: keep the logits

    store = get_forward_backward_func()(
        forward_step_func=step, data_iterator=iter([ids]), model=model, num_microbatches=1,
        seq_length=s, micro_batch_size=b, forward_only=True)
    out = store[0] if parallel_state.is_pipeline_last_stage() else \
        torch.empty(b, s, padded_vocab)
    dist.broadcast(out, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                   group=parallel_state.get_pipeline_model_parallel_group())
    return out


def loaded_logits(items: list[str], layout: str, parallel, ids: torch.Tensor) -> dict:
    """{"<name>@<layout>": logits} of each `name=checkpoint` in `items`, loaded at this
    layout (tied embeddings skip PP: the CPU limitation above)."""
    out = {}
    for item in items:
        name, path = item.split("=", 1)
        ckpt = checkpoint.resolve(path)
        cfg = checkpoint.read_recipe(ckpt).model
        if (not cfg.untie_embeddings) and parallel.pipeline_parallel > 1:
            continue
        model = build_model(cfg, parallel, seed=99)
        checkpoint.load_model(model, ckpt)
        model.eval()
        out[f"{name}@{layout}"] = full_logits(model, ids, cfg.padded_vocab_size)
    return out


def greedy(model, prompt: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    seq = prompt
    for _ in range(NEW_TOKENS):  # no KV cache: the whole sequence every step
        step_logits = full_logits(model, seq, cfg.padded_vocab_size)[:, -1, :cfg.vocab_size]
        seq = torch.cat([seq, step_logits.argmax(-1, keepdim=True)], dim=1)
    return seq


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--load", nargs="*", default=[])
    args = ap.parse_args()

    ids = hf_tokens()
    results = {"tokens": ids, "prompt": ids[:, :PROMPT_LEN]}
    for layout, parallel in LAYOUTS.items():
        init_distributed(parallel, seed=1234)
        for kind, fields in KINDS.items():
            cfg = ModelConfig(**TINY, **fields, untie_embeddings=(kind, layout) not in TIED)
            model = build_model(cfg, parallel, seed=1234)
            with checkpoint.Writer(args.out / f"{kind}_{layout}", 1,
                                   Recipe(model=cfg, parallel=parallel)) as folder:
                checkpoint.save_model(model, folder)
            model.eval()
            results[f"{kind}_{layout}"] = {
                "logits": full_logits(model, ids, cfg.padded_vocab_size),
                "greedy": greedy(model, results["prompt"], cfg)}
        results.update(loaded_logits(args.load, layout, parallel, ids))
        parallel_state.destroy_model_parallel()
    if dist.get_rank() == 0:
        torch.save(results, args.out / "reference.pt")
    destroy_distributed()


if __name__ == "__main__":
    main()
