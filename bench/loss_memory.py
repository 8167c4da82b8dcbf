"""Peak memory of one training step with the loss in chunks against the whole logits.

    python bench/loss_memory.py [--seq 8192] [--vocab 32000] [--chunks 0,2048,512]

One forward/backward of a small fp32 model (2 layers, hidden 512) at a long sequence and a
large vocabulary, where the logits are most of the step's memory, once per loss path
(`parallel.loss_chunk_tokens`: 0 is megatron's whole-logits path), each in its own
process. A step's peak is the process's peak resident memory during the step over its
resident memory just before it (Linux's VmHWM, reset through /proc/self/clear_refs; the
parameters' gradients are allocated by a warm-up step first, so both paths count the same
things). Prints the peak and the step's time per path, and their ratios to the whole-logits
path.
"""

import argparse
import ctypes
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
MODEL = dict(hidden_size=512, num_layers=2, num_attention_heads=8, ffn_hidden_size=1024)


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _settle() -> int:
    """Resident kB once freed memory is back with the system."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return _status_kb("VmRSS")


def measure(seq: int, vocab: int, chunk: int) -> dict:
    """Peak bytes above the step's start, and seconds, of one step (in this process)."""
    from megatron_stem.config import ModelConfig, ParallelConfig
    from megatron_stem.model import build_model
    from megatron_stem.runtime.parallel import init_distributed

    torch.set_num_threads(1)
    parallel = ParallelConfig(loss_chunk_tokens=chunk)
    init_distributed(parallel)
    net = build_model(ModelConfig(**MODEL, vocab_size=vocab, seq_length=seq), parallel)
    tokens = torch.randint(0, vocab, (1, seq + 1), generator=torch.Generator().manual_seed(0))

    def step():
        net(tokens[:, :-1], None, None, labels=tokens[:, 1:]).mean().backward()

    step()  # the parameters' gradients, kept (zeroed) for the measured step
    net.zero_grad(set_to_none=False)
    before = _settle()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    return {"peak_bytes": (_status_kb("VmHWM") - before) * 1024, "seconds": seconds}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--chunks", default="0,2048,512",
                    help="loss_chunk_tokens per path, comma-separated (0: whole logits)")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(measure(args.seq, args.vocab, args.child)))
        return
    logits = args.seq * args.vocab * 4
    print(f"one step at seq {args.seq:,} x vocab {args.vocab:,} (fp32 logits alone "
          f"{logits / 1e9:.2f} GB), model {MODEL}")
    print(f"{'loss path':<26}{'peak GB':>9}{'vs whole':>10}{'step s':>9}{'vs whole':>10}")
    base = None
    for chunk in (int(c) for c in args.chunks.split(",")):
        out = subprocess.run([sys.executable, __file__, "--seq", str(args.seq), "--vocab",
                              str(args.vocab), "--child", str(chunk)], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout
        result = json.loads(out.strip().splitlines()[-1])
        base = base or result
        name = f"chunks of {chunk:,} positions" if chunk else "whole logits (megatron)"
        print(f"{name:<26}{result['peak_bytes'] / 1e9:>9.2f}"
              f"{result['peak_bytes'] / base['peak_bytes']:>10.2f}{result['seconds']:>9.2f}"
              f"{result['seconds'] / base['seconds']:>10.2f}")


if __name__ == "__main__":
    main()
