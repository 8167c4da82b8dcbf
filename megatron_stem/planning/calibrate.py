"""Measure the `cpu` hardware profile on this machine.

Per core (one thread, as each training rank runs): DeepSpeed's CPU Adam kernel and the
same update in torch ops (elements/s), a row gather and a plain copy (GB/s, also with all
cores: the node's rate), the forward/backward FLOP/s of the calibration model (a dense
model of the mid-size shape bench/plan_calibration.py trains), and gloo's all-reduce bus
bandwidth and all-to-all bandwidth on two ranks. Each figure is the best of a few repeats
(other jobs on the machine only ever slow a run down).

    python -m megatron_stem.planning.calibrate   # prints the profile, caches it
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from megatron_stem.config import ModelConfig
from megatron_stem.planning.hardware import CACHE_DIR, Hardware, save

# The calibration shape: 32k vocabulary (the shipped corpus through a 32k BPE model), four
# STEM layers of eight, sized so DP4 fits in this machine's memory with replicated tables.
CALIBRATION_MODEL = dict(hidden_size=256, num_layers=8, num_attention_heads=4,
                         num_query_groups=2, ffn_hidden_size=1024, vocab_size=32000,
                         seq_length=256, rotary_base=10000.0)
MICRO_BATCH = 2


def _best(fn, repeats: int = 5) -> float:
    fn()  # warm-up: allocations, first-touch pages
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def adam_rate(kernel: str, elements: int = 1 << 25) -> float:
    """Elements/s of one in-place AdamW update of contiguous fp32 tensors, one thread
    (512 MB of state and grad: from DRAM, not the caches, as a table's update runs)."""
    from megatron_stem.training.engine import set_extensions_cache
    from megatron_stem.training.table_optim import AdamKernel

    set_extensions_cache()
    k = AdamKernel(kernel, (0.9, 0.95), 1e-8)
    p, g, m, v = (torch.rand(elements) for _ in range(4))
    step = iter(range(1, 1 << 30))
    return elements / _best(lambda: k.update(next(step), 1e-3, 0.1, p, g, m, v))


def copy_rates(rows: int = 65536, width: int = 1024, picked: int = 32768) -> tuple[float, float]:
    """(gather, memcpy) bytes written per second at the current thread count."""
    table = torch.randn(rows, width)
    ids = torch.randperm(rows)[:picked].sort().values
    out = torch.empty(picked, width)
    src = torch.randn(picked, width)
    nbytes = out.numel() * 4
    gather = nbytes / _best(lambda: torch.index_select(table, 0, ids, out=out))
    memcpy = nbytes / _best(lambda: out.copy_(src))
    return gather, memcpy


def compute_rate(steps: int = 3) -> float:
    """Forward/backward FLOP/s of the dense calibration model, one thread, world of one
    (FLOPs counted as the trainer counts them)."""
    from megatron_stem.config import ParallelConfig, Recipe
    from megatron_stem.model import build_model
    from megatron_stem.parallel import destroy_distributed, init_distributed
    from megatron_stem.planning.step import training_flops_per_token

    model = ModelConfig(**CALIBRATION_MODEL)
    init_distributed(ParallelConfig())
    try:
        net = build_model(model, ParallelConfig())
        g = torch.Generator().manual_seed(0)
        seq = torch.randint(0, model.vocab_size, (MICRO_BATCH, model.seq_length + 1), generator=g)

        def fwd_bwd():
            loss = net(seq[:, :-1], None, None, labels=seq[:, 1:]).float().mean()
            loss.backward()

        seconds = _best(fwd_bwd, steps)
    finally:
        destroy_distributed()
    return training_flops_per_token(Recipe(model=model)) * MICRO_BATCH * model.seq_length / seconds


def _gloo_worker(rank: int, world: int, path: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    n = 1 << 22  # 16 MB of fp32
    x = torch.ones(n)
    parts = [torch.empty(n // world) for _ in range(world)]
    sends = list(torch.ones(n).chunk(world))

    def barrier_then(fn):
        def run():
            dist.barrier()
            fn()
        return run

    ar = _best(barrier_then(lambda: dist.all_reduce(x)), 4)
    a2a = _best(barrier_then(lambda: dist.all_to_all(parts, sends)), 4)
    if rank == 0:
        busbw = 2 * n * 4 * (world - 1) / world / ar
        a2a_bw = n * 4 * (world - 1) / world / a2a
        with open(out, "w") as f:
            json.dump({"allreduce_busbw": busbw, "alltoall_bw": a2a_bw}, f)
    dist.destroy_process_group()


def gloo_rates(world: int = 2) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "gloo.json")
        mp.spawn(_gloo_worker, args=(world, os.path.join(tmp, "store"), out), nprocs=world)
        with open(out) as f:
            return json.load(f)


def measure_cpu() -> Hardware:
    """The `cpu` profile, measured now (about a minute)."""
    cores = len(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ds, pt = adam_rate("deepspeed"), adam_rate("torch")
        gather1, memcpy1 = copy_rates()
        torch.set_num_threads(cores)
        gather_n, memcpy_n = copy_rates()
    finally:
        torch.set_num_threads(threads)
    # a fresh process: the model measurement initializes torch.distributed
    flops = float(subprocess.run(
        [sys.executable, "-c", "from megatron_stem.planning.calibrate import compute_rate;"
         "import torch; torch.set_num_threads(1); print(compute_rate())"],
        check=True, capture_output=True, text=True).stdout.split()[-1])
    gloo = gloo_rates()
    return Hardware(
        name="cpu", peak_flops=flops, mfu=1.0, memory_bw=memcpy1, memory_bytes=0.0,
        nvlink_bw=0.0, nic_bw=0.0, nics_per_node=0, pinned_copy_bw=memcpy1,
        pageable_copy_bw=memcpy1, dram_bw=max(memcpy_n, memcpy1) * 2,  # read + write
        gather_bw=max(gather_n, gather1), cpu_adam_rate=ds, torch_adam_rate=pt, cores=cores,
        device_is_host=True, gloo_allreduce_busbw=gloo["allreduce_busbw"],
        gloo_alltoall_bw=gloo["alltoall_bw"])


if __name__ == "__main__":
    hw = measure_cpu()
    save(hw, CACHE_DIR / "cpu.json")
    print(hw.to_json())
