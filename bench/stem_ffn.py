"""STEM FFN vs dense SwiGLU FFN of the same width: forward+backward time, side by side.

    python bench/stem_ffn.py [--hidden 1024 --ffn 4096 --vocab 32000 --tokens 4096]

The FLOP floor of STEM/dense is 2/3: two of the three matmuls remain, the up-projection
becomes a row gather. Three STEM variants are timed: the table gradient as a dense
[vocab, ffn] tensor (what a plain optimizer needs), as row-sparse (what the table
optimizer consumes), and with the table frozen (the matmul-only floor).
"""

import argparse
import time

import torch

from megatron_stem.config import ModelConfig, ParallelConfig
from megatron_stem.model import build_model
from megatron_stem.runtime.parallel import destroy_distributed, init_distributed


def time_ffn(mlp, x, ids, iters: int) -> float:
    def step():
        out, _ = mlp(x, padding_mask=ids)
        out.backward(torch.ones_like(out))
        for p in mlp.parameters():
            p.grad = None

    for _ in range(2):
        step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="small sizes, a few seconds")
    args = ap.parse_args()
    if args.quick:
        args.hidden, args.ffn, args.vocab, args.tokens, args.iters = 256, 1024, 8000, 1024, 5

    init_distributed(ParallelConfig())
    cfg = ModelConfig(hidden_size=args.hidden, num_layers=2, num_attention_heads=8,
                      ffn_hidden_size=args.ffn, vocab_size=args.vocab, seq_length=args.tokens,
                      stem_layers=[1])
    layers = build_model(cfg, ParallelConfig()).decoder.layers
    dense, stem = layers[0].mlp, layers[1].mlp
    device = next(dense.parameters()).device
    x = torch.randn(args.tokens, 1, args.hidden, device=device, requires_grad=True)
    ids = torch.randint(0, args.vocab, (1, args.tokens), device=device)

    t_dense = time_ffn(dense, x, ids, args.iters)
    t_stem = time_ffn(stem, x, ids, args.iters)
    stem.table.sparse_grad = True
    t_sparse = time_ffn(stem, x, ids, args.iters)
    stem.table.weight.requires_grad_(False)
    t_frozen = time_ffn(stem, x, ids, args.iters)

    print(f"d={args.hidden} d_ff={args.ffn} vocab={args.vocab} tokens={args.tokens} "
          f"device={device} threads={torch.get_num_threads()}")
    print(f"{'variant':<28}{'ms/iter':>10}{'vs dense':>10}")
    for name, t in [("dense SwiGLU", t_dense), ("STEM, dense table grad", t_stem),
                    ("STEM, row-sparse table grad", t_sparse),
                    ("STEM, table frozen", t_frozen)]:
        print(f"{name:<28}{t * 1e3:>10.2f}{t / t_dense:>10.3f}")
    print("FLOP floor (2 of 3 matmuls)             0.667")
    destroy_distributed()


if __name__ == "__main__":
    main()
