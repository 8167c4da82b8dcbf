"""Training tokens/s of a STEM model against its dense baseline (same width and depth),
side by side in one run, through the real engine and table optimizer.

    python bench/train_throughput.py [--hidden 256 --layers 4 --ffn 1024 --vocab 8192]

On a GPU it also prints MFU (model FLOPs as in the trainer's log, over --peak-flops);
bench/gpu/train_1b_shape.sh runs it on a 1B-shaped model with few layers.
"""

import argparse
import time

import torch

from megatron_stem.model.accounting import account
from megatron_stem.config import ModelConfig, ParallelConfig, Recipe, TrainConfig
from megatron_stem.model import build_model
from megatron_stem.runtime.parallel import destroy_distributed, device, init_distributed
from megatron_stem.training.loop import train_step
from megatron_stem.training.engine import build_engine


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def tokens_per_s(recipe: Recipe, steps: int) -> float:
    model = build_model(recipe.model, recipe.parallel)
    engine, tables, update = build_engine(model, recipe)
    t = recipe.train
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, recipe.model.vocab_size,
                        (t.global_batch_size // t.micro_batch_size, t.micro_batch_size,
                         recipe.model.seq_length + 1), generator=g)
    # On the model's device, as the trainer's StepBatches hands them over.
    batches = [{"tokens": s[:, :-1], "labels": s[:, 1:],
                "loss_mask": torch.ones(s[:, 1:].shape, device=s.device)}
               for s in seq.to(device())]
    for i in range(steps + 1):
        if i == 1:  # the first step allocates optimizer state
            _synchronize()
            start = time.perf_counter()
        train_step(update, batches, 1e-3)
    _synchronize()
    return steps * t.global_batch_size * recipe.model.seq_length / (time.perf_counter() - start)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--placements", default="none,1/3,1/2,full")
    ap.add_argument("--updates", default="lazy,dense")
    ap.add_argument("--peak-flops", type=float, default=989e12)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    init_distributed(ParallelConfig())
    results, flops = {}, {}
    for placement in args.placements.split(","):
        for update in (args.updates.split(",") if placement != "none" else ("-",)):
            model = ModelConfig(hidden_size=args.hidden, num_layers=args.layers,
                                num_attention_heads=args.heads, num_query_groups=args.kv_heads,
                                ffn_hidden_size=args.ffn, vocab_size=args.vocab,
                                seq_length=args.seq, stem_layers=placement)
            recipe = Recipe(model=model, train=TrainConfig(
                micro_batch_size=args.micro_batch, global_batch_size=args.global_batch,
                dtype=args.dtype))
            if update != "-":
                recipe.optimizer.tables.update = update
            results[placement, update] = tokens_per_s(recipe, args.steps)
            flops[placement, update] = 6 * account(model).active_params + \
                12 * args.layers * args.hidden * args.seq
    dense = results.get(("none", "-"))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU, 1 thread"
    print(f"d={args.hidden} layers={args.layers} d_ff={args.ffn} vocab={args.vocab} "
          f"seq={args.seq} batch {args.global_batch} x {args.seq} tokens, {args.dtype}, {device}")
    print(f"{'stem_layers':<12}{'tables':<8}{'tokens/s':>10}{'vs dense':>10}{'MFU':>8}")
    for key, rate in results.items():
        mfu = f"{rate * flops[key] / args.peak_flops:.1%}" if torch.cuda.is_available() else "-"
        ratio = f"{rate / dense:.3f}" if dense else "-"
        print(f"{key[0]:<12}{key[1]:<8}{rate:>10.0f}{ratio:>10}{mfu:>8}")
    destroy_distributed()


if __name__ == "__main__":
    main()
