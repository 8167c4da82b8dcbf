"""Table optimizer step time against touched rows and against vocabulary size.

    python bench/table_optim.py [--width 1024] [--kernel deepspeed|torch]

`lazy` must follow the touched rows and stay flat in the vocabulary; `dense` follows the
vocabulary (every row every step). Printed side by side in one run, with the ratio.
"""

import argparse
import time

import torch

from megatron_stem.config.table_layout import TableLayout
from megatron_stem.tables.optimizer import TableOptimizer


def step_time(update: str, vocab: int, rows: int, width: int, kernel: str, iters: int) -> float:
    table = torch.nn.Parameter(torch.randn(vocab, width))
    opt = TableOptimizer([("t", table)], TableLayout(update=update, kernel=kernel), 1.0, 0.1,
                         (0.9, 0.95))
    ids = torch.randperm(vocab)[:rows]
    values = torch.randn(rows, width)
    total = 0.0
    for i in range(iters + 1):
        table.grad = torch.sparse_coo_tensor(ids[None], values, table.shape, is_coalesced=False)
        start = time.perf_counter()
        opt.sync_grads()
        opt.step(1e-3)
        if i:  # the first step allocates state
            total += time.perf_counter() - start
    return total / iters


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--kernel", default="deepspeed", choices=["deepspeed", "torch"])
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    w, k, n = args.width, args.kernel, args.iters
    print(f"width {w}, kernel {k}, 1 thread; ms per step")
    print(f"{'vocab':>8}{'rows':>8}{'lazy':>10}{'dense':>10}{'dense/lazy':>12}")
    for vocab, rows in [(32768, 512), (32768, 2048), (32768, 8192), (32768, 32768),
                        (8192, 2048), (65536, 2048), (131072, 2048)]:
        lazy, dense = step_time("lazy", vocab, rows, w, k, n), step_time("dense", vocab, rows, w, k, n)
        print(f"{vocab:>8}{rows:>8}{lazy * 1e3:>10.1f}{dense * 1e3:>10.1f}{dense / lazy:>12.1f}")


if __name__ == "__main__":
    main()
