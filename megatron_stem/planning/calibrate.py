"""Measure a hardware profile: the explicit step the planner's `cpu` profile comes from.

    python -m megatron_stem.planning.calibrate   # this machine: 3-4 minutes, with progress
    python -m megatron_stem.planning.calibrate --gpu h200 --out h200.json  # on a GPU node

`cpu`: every figure is what one training rank gets while the others run: each
micro-benchmark (microbench.py) runs in one process per core at the same time (one thread
each, as the ranks run), timed in the process's CPU time (which other jobs on a shared
machine do not inflate; the bench compares the trainer's parts in the same clock), at the
sizes the calibration step moves, best of a few repeats (other jobs only ever slow a run
down), slowest process: the tables' row Adam as the optimizer calls it (consecutive and
scattered rows), the torch kernel's arithmetic, torch.optim.AdamW (the backbone's optimizer
on CPU), a row gather, a copy into a reused buffer and one into a newly allocated one
(large buffers are fresh pages every time: page faults, several times slower), the step
boundary's collection of row gradients (RowGradSum through its hooks), the owners' sums,
the norm's squares, the publication's placing of gathered rows, the forward/backward
FLOP/s of the calibration model, and gloo's all-reduce, all-to-all and all-gather on one
rank per core (CPU time per byte moved) with the CPU time of a one-element all-reduce.

GPU (`--gpu`): the single-GPU constants of a published profile refit on this machine's GPU
(`measure_gpu`), what bench/gpu/run_all.sh runs on an H100 or H200.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from megatron_stem.config import ModelConfig
from megatron_stem.model.accounting import training_flops_per_token
from megatron_stem.planning.hardware import (
    CACHE_DIR,
    PROFILE_VERSION,
    PUBLISHED,
    Hardware,
    load_detected,
    save,
)
from megatron_stem.planning.microbench import best, copy_rates, flat_adam_rate, row_adam_rate
from megatron_stem.runtime.errors import cli

# The calibration shape: 32k vocabulary (the shipped corpus through a 32k BPE model), four
# STEM layers of eight, sized so DP4 with replicated tables fits in this shared machine's
# memory (d_ff 1024 was killed for memory at DP4 while other jobs ran).
CALIBRATION_MODEL = dict(hidden_size=256, num_layers=8, num_attention_heads=4,
                         num_query_groups=2, ffn_hidden_size=512, vocab_size=32000,
                         seq_length=256, rotary_base=10000.0)
MICRO_BATCH = 2
# The step boundary's parts made the larger part of a step (bench/plan_calibration.py
# `--preset boundary`): a narrow backbone, two wide STEM tables (32k x 2048), 4,096 tokens
# per rank per step.
BOUNDARY_MODEL = dict(hidden_size=64, num_layers=4, num_attention_heads=2, num_query_groups=1,
                      ffn_hidden_size=2048, vocab_size=32000, seq_length=256,
                      rotary_base=10000.0)
BOUNDARY_MICRO_BATCH = 8


def _say(progress, message: str) -> None:
    if progress is not None:
        progress(message)


def stderr_progress(message: str) -> None:
    print(f"calibrate: {message}", file=sys.stderr, flush=True)


def corun(call: str, processes: int, threads: int = 1) -> list:
    """`call`'s result in each of `processes` fresh processes of `threads` threads started
    together: what each rank gets while the others run."""
    code = (f"import torch\ntorch.set_num_threads({threads})\n"
            "from megatron_stem.planning.calibrate import *\n"
            f"from megatron_stem.planning.microbench import *\nprint(repr({call}))")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              text=True, env=env) for _ in range(processes)]
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"calibration step failed: {call}")
    return [ast.literal_eval(out.strip().splitlines()[-1]) for out in outs]


def compute_rate(model_kwargs: dict | None = None, micro_batch: int = MICRO_BATCH,
                 dtype: str = "fp32", steps: int = 3, stem_layers: str = "none") -> float:
    """Forward/backward seconds of a model (default: the dense calibration shape) on this
    process's device, world of one; STEM tables give row-sparse grads, as in training."""
    from megatron_stem.config import ParallelConfig
    from megatron_stem.model import build_model
    from megatron_stem.model.table import StemTable
    from megatron_stem.runtime.parallel import destroy_distributed, device, init_distributed

    model = ModelConfig(**(model_kwargs or CALIBRATION_MODEL), stem_layers=stem_layers)
    init_distributed(ParallelConfig())
    try:
        net = build_model(model, ParallelConfig(), params_dtype=_DTYPES[dtype])
        for m in net.modules():
            if isinstance(m, StemTable):
                m.sparse_grad = True
        g = torch.Generator().manual_seed(0)
        seq = torch.randint(0, model.vocab_size, (micro_batch, model.seq_length + 1),
                            generator=g).to(device())

        def fwd_bwd():
            loss = net(seq[:, :-1], None, None, labels=seq[:, 1:]).float().mean()
            loss.backward()
            net.zero_grad(set_to_none=True)
            _synchronize()

        return best(fwd_bwd, steps)
    finally:
        destroy_distributed()


def compute_seconds(model_kwargs: dict, micro_batch: int, dtype: str,
                    progress=None) -> tuple[float, float]:
    """(dense, STEM) forward/backward seconds of one micro-batch of the model as a rank runs
    it (STEM at 1/2 of the layers)."""
    call = f"compute_rate({model_kwargs!r}, {micro_batch}, {dtype!r}"
    _say(progress, "2/4 forward/backward of the dense calibration model")
    dense_s = _rank_seconds(call + ")")
    _say(progress, "3/4 ... and of its STEM version (the tables' rows)")
    return dense_s, _rank_seconds(call + ", stem_layers='1/2')")


def table_rows_bw(model_kwargs: dict, micro_batch: int, dtype: str, dense_s: float,
                  stem_s: float, hw: Hardware) -> float:
    """Bytes/s of the STEM tables' rows in forward/backward: the STEM model's time beyond
    the dense shape's less its fc1 saving (compute.py, on `hw`'s GEMM curve), over the
    passes over looked-up rows the planner counts; 0 (the memory's rate) when that is
    within 5% of the step, under this machine's noise."""
    from megatron_stem.config import Recipe, TrainConfig
    from megatron_stem.planning.compute import TABLE_ROW_PASSES, fc1_saving
    from megatron_stem.planning.workload import Cluster, workload

    recipe = Recipe(model=ModelConfig(**model_kwargs, stem_layers="1/2"), train=TrainConfig(
        micro_batch_size=micro_batch, global_batch_size=micro_batch, dtype=dtype))
    w = workload(recipe, Cluster(1, 1))
    extra = stem_s - (dense_s - fc1_saving(w, hw, 1)[1])
    rows = TABLE_ROW_PASSES * w.tokens * w.shape.width * w.shape.tables * w.dtype_bytes
    return rows / extra if extra > 0.05 * stem_s else 0.0


def _rank_seconds(call: str) -> float:
    """Seconds of `call` (which initializes torch.distributed) as a rank runs it: on a
    GPU in a fresh process; on the CPU in one process per core at once, the slowest."""
    if torch.cuda.is_available():
        return _in_fresh_process(call)
    return max(corun(call, len(os.sched_getaffinity(0))))


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_link_rates(nbytes: int = 1 << 30) -> dict:
    """Host<->device copy rates (the slower direction), pinned and pageable, and the
    device memory's copy rate (bytes read + written), on a GPU."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for name, pinned in (("pinned", True), ("pageable", False)):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)

        def copy(dst, src, pinned=pinned):
            dst.copy_(src, non_blocking=pinned)
            _synchronize()

        h2d = best(lambda host=host: copy(dev, host), 3)
        d2h = best(lambda host=host: copy(host, dev), 3)
        out[name] = nbytes / max(h2d, d2h)
    other = torch.empty_like(dev)
    out["device"] = 2 * nbytes / best(lambda: (other.copy_(dev), _synchronize()), 5)
    return out


def _gloo_worker(rank: int, world: int, path: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    n = 1 << 24  # 64 MB of fp32: the calibration step's grads (82 MB) and tables (66 MB)
    x = torch.ones(n)
    received = torch.empty(n)
    parts = [torch.empty(n // world) for _ in range(world)]

    def cpu_seconds(fn, repeats):
        """This rank's CPU time in `fn` (best of `repeats`), each call started together;
        a gloo rank sleeps while it waits for the others: CPU time is its work."""
        def run():
            dist.barrier()
            fn()
        return best(run, repeats, time.process_time)

    tiny = torch.ones(1)
    shard = torch.ones(n // world)
    # A 64 MB collective's CPU time moves by up to 2x from call to call on this machine
    # (1.2-2.4 GB/s all-reduce bus bandwidth as the best of 4): the best of 12 is stable.
    seconds = {"latency": cpu_seconds(lambda: dist.all_reduce(tiny), 20),
               "allreduce": cpu_seconds(lambda: dist.all_reduce(x), 12),
               # the tables' exchange's call (comm.Comm.all_to_all): gloo runs the list
               # form, `all_to_all`, several times slower (215 MB/s against 1.3 GB/s here)
               "alltoall": cpu_seconds(lambda: dist.all_to_all_single(received, x), 12),
               "allgather": cpu_seconds(lambda: dist.all_gather(parts, shard), 12)}
    slowest = [None] * world
    dist.all_gather_object(slowest, seconds)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({k: max(s[k] for s in slowest) for k in seconds} | {"bytes": n * 4}, f)
    dist.destroy_process_group()


def gloo_rates(alloc_copy_bw: float, world: int = 2) -> dict:
    """gloo's rates in the formulas of hardware.py (one rank's CPU time): all-reduce bus
    bandwidth, all-to-all bytes sent to the others per second, all-gather bytes received
    per second beyond the copy of the whole output through a new buffer (at
    `alloc_copy_bw`), and the one-element all-reduce's seconds."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "gloo.json")
        mp.spawn(_gloo_worker, args=(world, os.path.join(tmp, "store"), out), nprocs=world)
        with open(out) as f:
            t = json.load(f)
    moved = t["bytes"] * (world - 1) / world
    gather = max(t["allgather"] - t["bytes"] / alloc_copy_bw, 0.1 * t["allgather"])
    return {"allreduce_busbw": 2 * moved / t["allreduce"], "alltoall_bw": moved / t["alltoall"],
            "allgather_bw": moved / gather, "latency": t["latency"]}


def measure_cpu(progress=stderr_progress) -> Hardware:
    """The `cpu` profile, measured now (three to four minutes, saying what it measures as
    it goes): a rank's CPU time while every core runs a rank (module docstring)."""
    cores = len(os.sched_getaffinity(0))
    _say(progress, f"measuring this machine's cpu profile, one rank per core ({cores}); "
                   "3-4 minutes")
    _say(progress, "1/4 one rank's CPU rates: row Adam, copies, row gradients, norm")
    ranks = corun("rank_rates()", cores)
    rate = {k: min(r[k] for r in ranks) for k in ranks[0]}  # the slowest rank's
    dense_s, stem_s = compute_seconds(CALIBRATION_MODEL, MICRO_BATCH, "fp32", progress)
    flops = training_flops_per_token(ModelConfig(**CALIBRATION_MODEL)) * MICRO_BATCH * \
        CALIBRATION_MODEL["seq_length"] / dense_s
    flat = Hardware(**{**PUBLISHED["h200"].__dict__, "peak_flops": flops, "mfu": 1.0,
                       "gemm_curve": (), "device_is_host": True, "cores": cores})
    table_bw = table_rows_bw(CALIBRATION_MODEL, MICRO_BATCH, "fp32", dense_s, stem_s, flat)
    _say(progress, "4/4 gloo's all-reduce, all-to-all and all-gather")
    gloo = gloo_rates(rate["alloc_copy_bw"], cores)
    _say(progress, "done")
    return Hardware(
        name="cpu", peak_flops=flops, mfu=1.0, gemm_curve=(), memory_bw=rate["memory_bw"],
        table_rows_bw=table_bw, memory_bytes=0.0,
        nvlink_bw=0.0, nic_bw=0.0, nics_per_node=0, pinned_copy_bw=rate["memory_bw"],
        pageable_copy_bw=rate["memory_bw"], dram_bw=rate["memory_bw"] * cores,
        gather_bw=rate["gather_bw"] * cores, cpu_adam_rate=rate["cpu_adam_rate"],
        scattered_adam_rate=rate["scattered_adam_rate"],
        torch_adam_rate=rate["torch_adam_rate"], cores=cores,
        backbone_adam_rate=rate["backbone_adam_rate"], alloc_copy_bw=rate["alloc_copy_bw"],
        row_grads_bw=rate["row_grads_bw"], pack_bw=rate["pack_bw"], norm_bw=rate["norm_bw"],
        place_bw=rate["place_bw"],
        device_is_host=True, gloo_allreduce_busbw=gloo["allreduce_busbw"],
        gloo_alltoall_bw=gloo["alltoall_bw"], gloo_allgather_bw=gloo["allgather_bw"],
        collective_latency=gloo["latency"], version=PROFILE_VERSION)


def measure_and_save(path: Path | None = None, progress=stderr_progress) -> Hardware:
    """Measure the `cpu` profile and write it where `hardware.load("cpu")` reads it."""
    hw = measure_cpu(progress)
    path = path or CACHE_DIR / "cpu.json"
    save(hw, path)
    _say(progress, f"wrote {path}")
    return hw


def _in_fresh_process(call: str) -> float:
    """A measurement that initializes torch.distributed, in a child process."""
    code = f"from megatron_stem.planning.calibrate import *\nprint({call})"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True).stdout
    return float(out.split()[-1])


# The 1B model's layer shapes (Llama-3.2-1B) cut to a few layers: what one GPU measures.
GPU_MODEL_1B = dict(hidden_size=2048, num_layers=4, num_attention_heads=32,
                    num_query_groups=8, ffn_hidden_size=8192, vocab_size=128256,
                    seq_length=2048, rotary_base=500000.0)
# The same code path at toy sizes, for a dry run of bench/gpu/run_all.sh on a CPU.
TINY_MODEL = dict(hidden_size=64, num_layers=4, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=128, vocab_size=32000, seq_length=64, rotary_base=10000.0)


def measure_gpu(name: str, tiny: bool = False, kernel: str = "deepspeed") -> Hardware:
    """Refit a GPU profile's single-node constants on the GPU of this machine: achieved
    MFU of the forward/backward at the 1B layer shapes (bf16), HBM copy rate, pinned and
    pageable host<->device rates, and this host's CPU Adam, DRAM and gather rates. NVLink
    and InfiniBand stay published (one GPU cannot measure them). `tiny`: the same steps
    at toy sizes, on whatever device there is (a dry run). `kernel: torch` where
    DeepSpeed's CPU Adam cannot be built: its rate is then the torch kernel's."""
    base = PUBLISHED[name]
    cores = len(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    size = 1 << (20 if tiny else 25)
    try:
        pt = flat_adam_rate("torch", size)
        rows = size // (256 if tiny else 8192)
        ds = row_adam_rate("deepspeed", rows, 256 if tiny else 8192) \
            if kernel == "deepspeed" else pt
        torch.set_num_threads(cores)
        gather, memcpy = copy_rates(*((4096, 256, 1024) if tiny else ()))
    finally:
        torch.set_num_threads(threads)
    model, mbs = (TINY_MODEL, 2) if tiny else (GPU_MODEL_1B, 4)
    dense_s, stem_s = compute_seconds(model, mbs, "bf16")
    flops = training_flops_per_token(ModelConfig(**model)) * mbs * model["seq_length"] / dense_s
    fit = dict(mfu=min(1.0, flops / base.peak_flops), cpu_adam_rate=ds, torch_adam_rate=pt,
               cores=cores, dram_bw=memcpy, gather_bw=gather,
               gemm_curve=gemm_curve(model, mbs, base.peak_flops))
    fit["table_rows_bw"] = table_rows_bw(model, mbs, "bf16", dense_s, stem_s,
                                         dataclasses.replace(base, **fit))
    if torch.cuda.is_available():
        links = copy_link_rates(1 << (24 if tiny else 30))
        fit.update(pinned_copy_bw=links["pinned"], pageable_copy_bw=links["pageable"],
                   memory_bw=links["device"])
    return dataclasses.replace(base, **fit)


def gemm_curve(model: dict, micro_batch: int, peak_flops: float) -> tuple:
    """The GEMM efficiency curve refit at the model's own linear layers (QKV, attention
    output, fc1 fused and the STEM gate alone, fc2, the output layer): per layer the
    forward, input-gradient and weight-gradient GEMMs of one micro-batch in bf16, as
    ((FLOPs of one GEMM, achieved fraction of peak), ...). On a CPU (a dry run) the same
    GEMMs in fp32, over the GPU's peak: the steps, not a GPU's figures."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    h, f, v = model["hidden_size"], model["ffn_hidden_size"], model["vocab_size"]
    kv = h // model["num_attention_heads"] * model["num_query_groups"]
    t = micro_batch * model["seq_length"]
    points = []
    for fan_in, fan_out in ((h, h + 2 * kv), (h, h), (h, 2 * f), (h, f), (f, h), (h, v)):
        x = torch.randn(t, fan_in, device=dev, dtype=dtype)
        w = torch.randn(fan_out, fan_in, device=dev, dtype=dtype)
        dy = torch.randn(t, fan_out, device=dev, dtype=dtype)

        def gemms(x=x, w=w, dy=dy):
            (x @ w.t(), dy @ w, dy.t() @ x)
            _synchronize()

        seconds = best(gemms, 3, time.perf_counter)
        flops = 2 * t * fan_in * fan_out
        points.append((float(flops), min(1.0, 3 * flops / seconds / peak_flops)))
    return tuple(sorted(points))


@cli
def main() -> int:
    ap = argparse.ArgumentParser(description="Measure a hardware profile on this machine")
    ap.add_argument("--gpu", choices=["h100", "h200", "auto"],
                    help="refit this GPU profile (auto: this machine's GPU's)")
    ap.add_argument("--tiny", action="store_true", help="toy sizes (a dry run)")
    ap.add_argument("--kernel", default="deepspeed", choices=["deepspeed", "torch"],
                    help="the CPU Adam the tables will run (torch: DeepSpeed's cannot build)")
    ap.add_argument("--out", help="where to write the profile (default: the planner's cache)")
    args = ap.parse_args()
    if args.gpu:
        name = load_detected(args.gpu).name if args.gpu == "auto" else args.gpu
        hw = measure_gpu(name, args.tiny, args.kernel)
        save(hw, Path(args.out) if args.out else CACHE_DIR / f"{hw.name}.json")
    else:
        hw = measure_and_save(Path(args.out) if args.out else None)
    print(hw.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
