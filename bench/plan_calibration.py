"""The step planner against measured steps on this machine: predicted vs measured, per
component, side by side.

    python bench/plan_calibration.py [--dp 2,4] [--variants device/dense/sharded,...]
        [--steps 3] [--calibrate] [--clock cpu|wall] [--preset cpu|gpu-1b|tiny]

A mid-size STEM model (megatron_stem/planning/calibrate.py: vocab 32k, d 256, d_ff 512,
8 layers, 4 STEM at 1/2, seq 256, micro-batch 2, fp32) trains on real text (the shipped
corpus through a 32k BPE model) under torchrun with gloo, at each DP size, each variant
(placement/update/partition[/overlap]), through the real engine and table optimizer.
Each step is timed in the parts the planner splits it into (`timed_step`): forward/
backward, DeepSpeed's gradient reduction, its step, the tables' gradient sync, their Adam
and the publication of their rows. The planner (`cpu` profile, measured once and cached;
--calibrate re-measures) predicts the same parts from the Zipf row model, and again from
the row counts the run measured. Target: within 25% for every major component. Ends with
the table of bench/README.md.

Clocks: this machine's two cores are shared with other jobs, which inflate wall time at
random, so on a CPU the parts are compared in each rank's CPU time (all its threads;
`--clock wall` for an idle machine, and on GPUs, where it is the default), and the cpu
profile's figures are CPU time too, measured with every core running a rank; per part
the fastest measured step is compared (noise only ever slows a part), the slowest rank's.
"""

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "data_corpus" / "gcide.jsonl.gz"


# -- worker (one torchrun rank) -----------------------------------------------------------


def _preset(name: str) -> tuple[dict, int, str]:
    """(model shape, micro-batch size, dtype): `cpu` the calibration shape; `boundary` one
    whose step is mostly the tables' step boundary; `gpu-1b` the 1B layer shapes cut to 4
    layers (one H200); `tiny` a dry run of the GPU script on a CPU."""
    from megatron_stem.planning import calibrate

    return {"cpu": (calibrate.CALIBRATION_MODEL, calibrate.MICRO_BATCH, "fp32"),
            "boundary": (calibrate.BOUNDARY_MODEL, calibrate.BOUNDARY_MICRO_BATCH, "fp32"),
            "gpu-1b": (calibrate.GPU_MODEL_1B, 4, "bf16"),
            "tiny": (calibrate.TINY_MODEL, 2, "fp32")}[name]


def _recipe(variant: str, dp: int, microbatches: int, preset: str, kernel: str = "deepspeed"):
    """`variant`: "dense" (the baseline) or placement/update/partition[/overlap[/device]]
    (`device`: where the tables' optimizer state is, `cpu` or `accelerator`)."""
    from megatron_stem.config import (ModelConfig, OptimizerConfig, Recipe, TableOptimizerConfig,
                                      TableStorageConfig, TrainConfig, from_dict)

    shape, micro, dtype = _preset(preset)
    fields = dict(zip(("placement", "update", "partition", "overlap", "device"),
                      variant.split("/"))) if variant != "dense" else {}
    update = fields.pop("update", "dense")
    optimizer = OptimizerConfig(tables=TableOptimizerConfig(
        update=update, kernel=kernel, device=fields.pop("device", "cpu")))
    stem = "none" if variant == "dense" else "1/2"
    return Recipe(model=ModelConfig(**shape, stem_layers=stem), optimizer=optimizer,
                  tables=from_dict(TableStorageConfig, fields),
                  train=TrainConfig(micro_batch_size=micro, dtype=dtype,
                                    global_batch_size=micro * microbatches * dp))


def _microbatches(ids: np.ndarray, steps: int, per_step: int, micro: int, seq: int,
                  rank: int, seed=0):
    """Each rank's micro-batches of random text windows, step by step, on its device."""
    from megatron_stem.runtime.parallel import device

    rng = np.random.default_rng(seed + 1000 * rank)
    out = []
    for _ in range(steps):
        mbs = []
        for _ in range(per_step):
            starts = rng.integers(0, ids.size - seq - 1, micro)
            w = torch.from_numpy(np.stack([ids[s:s + seq + 1] for s in starts])).to(device())
            mbs.append({"tokens": w[:, :-1].contiguous(), "labels": w[:, 1:].contiguous(),
                        "loss_mask": torch.ones(micro, seq, device=w.device)})
        out.append(mbs)
    return out


class PartTimer:
    """Times the parts of a step in wall time and in this process's CPU time (all its
    threads): on a shared machine other jobs inflate the first, not the second."""

    def __init__(self):
        self.wall, self.cpu = {}, {}
        self._mark = self._now()
        self._inner = [0.0, 0.0]  # time since the last lap already charged by `charged`
        self._open = threading.local()  # per thread: the charged calls it is inside

    @staticmethod
    def _now() -> tuple[float, float]:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter(), time.process_time()

    def _add(self, part: str, seconds: tuple[float, float]) -> None:
        for clock, t in zip((self.wall, self.cpu), seconds):
            clock[part] = clock.get(part, 0.0) + t

    def lap(self, part: str | None) -> None:
        """Charge the time since the last lap to `part` (None: to nothing), less what
        `charged` calls took meanwhile."""
        now = self._now()
        if part is not None:
            self._add(part, [now[i] - self._mark[i] - self._inner[i] for i in (0, 1)])
        self._mark, self._inner = now, [0.0, 0.0]

    @contextlib.contextmanager
    def charged(self, obj, method: str, part: str):
        """While in the block, the calls of `obj.method` are charged to `part` (and not to
        the lap they run in): how the trainer's parts are split as the planner splits
        them. A charged call inside another is charged to its own part only."""
        fn = getattr(obj, method)
        stack = self._open

        def timed(*args, **kwargs):
            start = self._now()
            if not hasattr(stack, "calls"):
                stack.calls = []
            stack.calls.append([0.0, 0.0])  # what charged calls inside this one take
            try:
                return fn(*args, **kwargs)
            finally:
                spent = [a - b for a, b in zip(self._now(), start)]
                inner = stack.calls.pop()
                self._add(part, [a - b for a, b in zip(spent, inner)])
                outer = stack.calls[-1] if stack.calls else self._inner
                outer[:] = [a + b for a, b in zip(outer, spent)]

        own = vars(obj).get(method)  # an attribute of the instance, or its class's method
        setattr(obj, method, timed)
        try:
            yield
        finally:
            if own is None:
                delattr(obj, method)
            else:
                setattr(obj, method, own)


def timed_step(update, mbs, next_mbs=None) -> dict:
    """train.train_step (given the next step's ids, as the trainer does for `overlap:
    next_step`), each part timed in both clocks: forward/backward, DeepSpeed's gradient
    reduction (its hooks in the boundary backward and its epilogue), the tables' gradient
    sync split as the planner splits it (collecting the row gradients, their exchange to
    the owners, the norm: the finite check, squares and copies of `sync_grads` and
    `grad_norm_sq` inside DeepSpeed's step), DeepSpeed's step, the tables' Adam and their
    rows' publication (the all-gathers to the other ranks' tables). A `next_step` update
    is waited for in the table step, in both clocks: its parts are measured whole (CPU time
    counts its work wherever it runs), and it does not run into the next step's timing
    (what the overlap hides is the planner's model, not a part measured here)."""
    from megatron_stem.training.loop import _token_mean_loss
    from megatron_stem.tables.row_grads import RowGradSum

    engine, tables = update.engine, update.tables
    shards = getattr(tables.partition, "shards", None)
    t = PartTimer()
    with contextlib.ExitStack() as stack:
        for obj, method, part in (
                (engine, "allreduce_gradients", "backbone_reduce"),
                (engine.optimizer, "reduce_independent_p_g_buckets_and_remove_grads",
                 "backbone_reduce"),
                (tables, "_local_row_grads", "row_grads"),
                (RowGradSum, "_sum", "row_grads"),  # (in the last backward, staged rows)
                (tables.partition, "sync", "exchange"),
                (tables, "sync_grads", "norm"), (tables, "grad_norm_sq", "norm"),
                (engine, "step", "backbone_step")):
            if obj is not None and hasattr(obj, method):
                stack.enter_context(t.charged(obj, method, part))
        if shards is not None:
            for publish in ("gather_shards", "gather_rows"):
                stack.enter_context(t.charged(shards, publish, "publish"))
        tables.stage(mbs)
        t.lap("compute")
        for i, mb in enumerate(mbs):
            engine.backward(_token_mean_loss(engine, mb))
            t.lap("compute")
            if i + 1 < len(mbs):
                engine.step()
                t.lap(None)  # (DeepSpeed's micro-step: charged to backbone_step)
        next_ids = [mb["tokens"] for mb in next_mbs] if next_mbs else None
        update.apply(1e-3, 1.0, next_ids)  # the rest of it: the tables' step
        tables.finish()
        t.lap("table_adam")
    for c in (t.wall, t.cpu):
        for part in PARTS:
            c.setdefault(part, 0.0)
        c["step"] = sum(v for k, v in c.items() if k != "step")
    # host tables: the forwards' wait for staged rows, out of the compute's wall time (in
    # CPU time the staging threads' work is part of the compute: not separable)
    wait = tables.host_stats().get("prefetch_wait_ms", 0.0) / 1e3
    t.wall["compute"] -= wait
    t.wall["staging_wait"], t.cpu["staging_wait"] = wait, 0.0
    return {"wall": t.wall, "cpu": t.cpu}


def boundary_segments(update, steps: list) -> list[float]:
    """Seconds from the end of each step's last backward to the next step's first table
    lookup, steps run back to back as train.train_step runs them (an overlapped update is
    not waited for: the lookup waits for its own rows). The end of the backward is its last
    kernel on the compute stream, before DeepSpeed's epilogue waits for the reduction's
    tail (the planner's segment starts there, `step.boundary_segment_seconds`); on a GPU
    both ends are CUDA events on that stream (no sync, which would also wait for the row
    gradients' sum on its side stream), on a CPU the host's clock."""
    from megatron_stem.model.table import StemTable
    from megatron_stem.training.loop import train_step

    engine = update.engine
    first = next(m for m in engine.module.modules() if isinstance(m, StemTable))
    marks, out = {}, []
    cuda = torch.cuda.is_available()

    def mark():
        if not cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(start, end) -> float:
        if not cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def looked_up(module, inputs, output):
        if "backward_end" in marks and "lookup" not in marks:
            marks["lookup"] = mark()

    epilogue = engine._backward_epilogue

    def timed_epilogue(*args, **kwargs):
        if engine.is_gradient_accumulation_boundary():  # the step's last backward
            if "lookup" in marks:  # the segment that ended in this step's first lookup
                out.append(seconds(marks["backward_end"], marks["lookup"]))
            marks.clear()
            marks["backward_end"] = mark()
        return epilogue(*args, **kwargs)

    hook = first.register_forward_hook(looked_up)
    engine._backward_epilogue = timed_epilogue
    try:
        for mbs, next_mbs in zip(steps, steps[1:]):
            train_step(update, mbs, 1e-3, [mb["tokens"] for mb in next_mbs])
    finally:
        hook.remove()
        del engine._backward_epilogue
        update.tables.finish()
    return out


def worker(args) -> None:
    import torch.distributed as dist

    from megatron_stem.model import build_model
    from megatron_stem.runtime.parallel import destroy_distributed, init_distributed
    from megatron_stem.training.engine import build_engine

    ids = np.load(args.ids)
    results = {}
    recipe0 = _recipe("dense", 1, args.microbatches, args.preset)
    init_distributed(recipe0.parallel)
    rank, dp = dist.get_rank(), dist.get_world_size()
    steps = _microbatches(ids, args.steps + 2, args.microbatches,
                          recipe0.train.micro_batch_size, recipe0.model.seq_length, rank)
    for variant in args.variants.split(","):
        recipe = _recipe(variant, dp, args.microbatches, args.preset, args.kernel)
        torch.manual_seed(0)
        engine, tables, update = build_engine(build_model(
            recipe.model, recipe.parallel, tables=recipe.tables), recipe)
        times, rows, segments = [], [], []
        if args.segment and variant.count("/") >= 3 and variant.split("/")[3] == "next_step":
            segments = boundary_segments(update, steps)
        for i, (mbs, next_mbs) in enumerate(zip(steps, steps[1:])):
            dist.barrier()
            t = timed_step(update, mbs, next_mbs)
            stats = tables.stats()  # waits for a next_step update: its counters are in
            t["comm_bytes"], t["adam_elements"] = stats["comm_bytes"], stats["adam_elements"]
            if i:  # the first step allocates the optimizer states
                times.append(t)
            tokens = [mb["tokens"] for mb in mbs]
            rows.append({"rank_rows": torch.unique(torch.cat([x.flatten() for x in tokens]))
                         .numel(), "microbatch_rows": sum(torch.unique(x).numel()
                                                          for x in tokens),
                         "union_rows": tables.touched_rows})
        tables.close()
        del engine, tables, update
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        # per clock and part the fastest of the steps (noise only ever slows a part down);
        # over ranks the slowest; rows averaged
        best = {clock: {k: min(t[clock][k] for t in times) for k in times[0][clock]}
                for clock in ("wall", "cpu")}
        mean_rows = {k: statistics.mean(r[k] for r in rows) for k in rows[0]}
        gathered = [None] * dp
        counted = {k: times[-1][k] for k in ("comm_bytes", "adam_elements")}
        dist.all_gather_object(gathered, (best, mean_rows, counted, segments))
        results[variant] = {
            "segment": max(min(g[3]) for g in gathered) if segments else None,
            "parts": {clock: {k: max(g[0][clock][k] for g in gathered) for k in best[clock]}
                      for clock in best},
            "counted": gathered[0][2],
            "rows": {k: statistics.mean(g[1][k] for g in gathered) for k in mean_rows}
            | {"longest_rank_rows": max(g[1]["rank_rows"] for g in gathered)}}
    if rank == 0:
        Path(args.out).write_text(json.dumps(results))
    destroy_distributed()


# -- launcher: predict, run, compare ------------------------------------------------------


def text_ids(tmp: Path) -> Path:
    """The corpus through a 32k BPE model (trained once, cached), as a .npy of ids."""
    from megatron_stem.data.tokenizer_training import TokenizerTrainingConfig, train_sentencepiece
    from megatron_stem.planning.hardware import CACHE_DIR
    from megatron_stem.planning.rows import corpus_ids

    model = CACHE_DIR / "gcide32k.model"
    if not model.is_file():
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        train_sentencepiece(TokenizerTrainingConfig(
            inputs=[str(CORPUS)], output_prefix=str(CACHE_DIR / "gcide32k"), vocab_size=32000,
            threads=os.cpu_count() or 1), log=None)
    path = tmp / "ids.npy"
    np.save(path, corpus_ids(str(model), str(CORPUS)))
    return path


# Which of the planner's components make each measured part (by the start of their names;
# the rest of the `compute`, `reduction` and `backbone` phases are those parts).
PART_OF = {"row_grads": ("collect row grads",),
           "exchange": ("row ids", "pack, sum", "grad all-reduce", "grad reduce",
                        "owned grads", "grads to owners"),
           "norm": ("finite check", "norm:", "tables' grads made", "D2H grads"),
           "publish": ("all-gather updated rows", "H2D updated rows", "place gathered rows"),
           "table_adam": ("CPU Adam", "accelerator Adam", "row gather/scatter", "launch:")}
PARTS = ("compute", "backbone_reduce", "backbone_step", "row_grads", "exchange", "norm",
         "table_adam", "publish", "staging_wait", "step")


def part_of(component) -> str:
    for part, names in PART_OF.items():
        if component.name.startswith(names):
            return part
    return {"compute": "compute", "staging": "compute", "reduction": "backbone_reduce",
            "backbone": "backbone_step"}[component.phase]


def predict(variant: str, dp: int, args, hw, rows: dict | None):
    """The planner's parts for one variant, split as `timed_step` measures them."""
    from megatron_stem.planning import step

    recipe = _recipe(variant, dp, args.microbatches, args.preset, args.kernel)
    cluster = step.Cluster(1, dp)
    w = step.workload(recipe, cluster, rows_override=rows)
    p = step.plan(w, None if variant == "dense" else step.configured_option(recipe),
                  cluster, hw)
    parts = dict.fromkeys(PARTS, 0.0)
    for c in p.components:
        parts[part_of(c)] += c.seconds
    staging = [c for c in p.components if c.phase == "staging"]
    if args.clock == "cpu":  # CPU time counts work, hidden or not; staging threads' too
        parts["step"] = sum(c.seconds for c in p.components)
    else:
        parts["compute"] -= p.seconds("staging")
        parts["staging_wait"] = step.exposed_staging_seconds(w, staging, p.seconds("compute"))
        parts["step"] = p.step_s
    parts.update({"comm_bytes": 0, "adam_elements": 0} |
                 {k.split("/")[1]: v for k, v in p.counters.items()})
    if p.option is not None and p.option.overlap == "next_step":
        parts["segment"] = step.boundary_segment_seconds(w, p)
    return parts, w.rows


# The 1B step's tables' CPU work on one node: one DP32 shard of a table (of five), its
# rows consecutive in a separate fp32 master, the new rows written in bf16.
SHARD_ROWS_1B, WIDTH_1B, TABLES_1B = 128256 // 32, 8192, 5


def node_model(processes: int, threads: int, tiny: bool = False) -> None:
    """The tables' row Adam of `processes` ranks of `threads` threads sharing this host's
    DRAM, measured, against the model of `hardware.node_cpu_seconds` built from this
    host's rates with every core busy (one process per core, one thread each: a core's
    rate and the DRAM's copy rate); then the same model for a DGX H100/H200 node (8 ranks
    of 14 cores, 430 GB/s), scaled by hardware.py's documented constants."""
    from megatron_stem.planning import calibrate, hardware

    cores = len(os.sched_getaffinity(0))
    rows, width = (256, 1024) if tiny else (SHARD_ROWS_1B, WIDTH_1B)
    call = f"row_adam_rate('deepspeed', {rows}, {width})"
    per_core = min(calibrate.corun(call, cores))
    dram = sum(calibrate.corun("dram_copy_rate()", cores))
    ranks = min(calibrate.corun(call, processes, threads))
    elements = SHARD_ROWS_1B * WIDTH_1B
    h200 = hardware.PUBLISHED["h200"]
    nbytes = h200.row_adam_bytes_per_element
    model = min(per_core * threads, dram / processes / nbytes)
    print(f"\nnode model of the tables' row Adam ({rows:,} x {width:,} rows per "
          f"call, bf16 out, {nbytes} B of DRAM traffic per element):")
    print(f"  this host, {cores} cores busy: {per_core / 1e9:.2f} G elem/s per core, DRAM copy "
          f"{dram / 1e9:.1f} GB/s (read + written)")
    print(f"  {processes} ranks x {threads} threads here: measured {ranks / 1e9:.2f} G elem/s "
          f"per rank, model {model / 1e9:.2f} ({model / ranks:.2f} x measured; "
          f"{'cores' if per_core * threads < dram / processes / nbytes else 'DRAM'} bind)")
    ranks_node, threads_node = 8, h200.cores // 8
    compute = per_core * hardware.NODE_CORE_SPEED * threads_node
    memory = h200.dram_bw / ranks_node / nbytes
    step = TABLES_1B * elements / min(compute, memory)
    print(f"  a DGX H100/H200 node, {ranks_node} ranks x {threads_node} cores, "
          f"{h200.dram_bw / 1e9:.0f} GB/s: cores {compute / 1e9:.1f}, DRAM "
          f"{memory / 1e9:.2f} G elem/s per rank: the 1B step's {TABLES_1B} shards "
          f"({TABLES_1B * elements / 1e6:.0f}M elements) in {step * 1e3:.0f} ms per rank "
          f"(the h200 profile's per-core rate: {h200.cpu_adam_rate / 1e9:.2f} G elem/s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", default="2,4")
    ap.add_argument("--variants", default="device/dense/replicated,device/dense/sharded,"
                    "device/lazy/sharded,host/dense/sharded,device/dense/sharded/next_step",
                    help="dense, or placement/update/partition[/overlap], comma-separated")
    ap.add_argument("--microbatches", type=int, default=2, help="per rank per step")
    ap.add_argument("--steps", type=int, default=3, help="measured steps (after a first)")
    ap.add_argument("--calibrate", action="store_true",
                    help="measure the cpu profile first (3-4 minutes, with progress)")
    ap.add_argument("--preset", default="cpu", choices=["cpu", "boundary", "gpu-1b", "tiny"],
                    help="model shape: cpu (the calibration shape), boundary (the tables' "
                         "step boundary the larger part), gpu-1b, tiny (dry run)")
    ap.add_argument("--kernel", default="deepspeed", choices=["deepspeed", "torch"],
                    help="the tables' CPU Adam")
    ap.add_argument("--clock", choices=["cpu", "wall"],
                    help="compare in each rank's CPU time (default on a CPU: other jobs on "
                         "a shared machine inflate wall time) or wall time (default on GPUs)")
    ap.add_argument("--hardware", default="cpu", help="the planner's profile to predict with")
    ap.add_argument("--profile", help="a profile JSON to predict with (bench/gpu/run_all.sh)")
    ap.add_argument("--segment", action="store_true",
                    help="also time the step boundary of `next_step` variants (wall time, "
                         "from the last backward to the next step's first table lookup)")
    ap.add_argument("--node-model", metavar="PROCESSES,THREADS",
                    help="only the tables' row Adam of PROCESSES ranks of THREADS threads "
                         "sharing this host's DRAM, against the node model")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if args.node_model:
        node_model(*map(int, args.node_model.split(",")), tiny=args.preset == "tiny")
        return
    if args.clock is None:
        args.clock = "wall" if torch.cuda.is_available() else "cpu"
    from megatron_stem.planning import calibrate, hardware

    if args.calibrate:
        calibrate.measure_and_save()
    hw = hardware.read(args.profile) if args.profile else hardware.load(args.hardware)
    print(f"{hw.name} profile: {hw.peak_flops * hw.mfu / 1e9:.1f} GFLOP/s per rank, CPU Adam "
          f"{hw.cpu_adam_rate / 1e9:.2f} G elem/s per core, {hw.cores} cores; load average "
          f"{os.getloadavg()[0]:.1f} at start")
    worst, summary = 0.0, []
    with tempfile.TemporaryDirectory() as tmp:
        ids = text_ids(Path(tmp))
        for dp in map(int, args.dp.split(",")):
            out = Path(tmp) / f"dp{dp}.json"
            # each rank its share of the cores (one thread each on this machine)
            threads = max(1, len(os.sched_getaffinity(0)) // dp)
            env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}" + os.environ.get(
                "PYTHONPATH", ""), OMP_NUM_THREADS=str(threads))
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            f"--nproc_per_node={dp}", __file__, "--worker", "--ids", str(ids),
                            "--out", str(out), "--variants", args.variants, "--steps",
                            str(args.steps), "--microbatches", str(args.microbatches),
                            "--preset", args.preset, "--kernel", args.kernel,
                            "--clock", args.clock] + (["--segment"] if args.segment else []),
                           check=True, env=env, stdout=subprocess.DEVNULL)
            measured = json.loads(out.read_text())
            for variant, m in measured.items():
                # in CPU time no rank waits for a core: predict without time-sharing
                hw_dp = hw if args.clock == "wall" else dataclasses.replace(
                    hw, cores=max(hw.cores, dp))
                zipf, modelled = predict(variant, dp, args, hw_dp, None)
                seen = {k: round(v) for k, v in m["rows"].items()}
                with_rows, _ = predict(variant, dp, args, hw_dp, seen)
                parts = m["parts"][args.clock]
                print(f"\nDP{dp} {variant}: rows per step rank {seen['rank_rows']} (Zipf "
                      f"{modelled.rank_rows}), union {seen['union_rows']} (Zipf "
                      f"{modelled.union_rows}), staged {seen['microbatch_rows']} (Zipf "
                      f"{modelled.microbatch_rows}); rank 0 counted comm bytes "
                      f"{m['counted']['comm_bytes']:,.0f} (planner {with_rows['comm_bytes']:,.0f}),"
                      f" Adam elements {m['counted']['adam_elements']:,.0f} (planner "
                      f"{with_rows['adam_elements']:,.0f})")
                other = "cpu" if args.clock == "wall" else "wall"
                print(f"  {'part (s)':<16}{'measured':>10}{'predicted':>11}{'ratio':>7}"
                      f"{'w/ rows':>9}{'ratio':>7}   ({args.clock} time; step in {other} "
                      f"time {m['parts'][other]['step']:.3f} s)")
                cells = {}
                for part in PARTS:
                    got = parts[part]
                    a, b = zipf[part], with_rows[part]
                    if got < 0.005 and a < 0.005:
                        continue  # below timer noise at this size
                    ra, rb = a / max(got, 1e-9), b / max(got, 1e-9)
                    note = ""
                    if part in ("table_adam", "publish") and args.clock == "wall" and \
                            variant.endswith("next_step"):
                        note = "  (runs during the next step: compare the steps)"
                    elif got < 0.05 * parts["step"]:
                        note = "  (minor: under 5% of the step)"
                    else:
                        worst = max(worst, abs(rb - 1))
                    cells[part] = (got, rb, bool(note))
                    print(f"  {part:<16}{got:>10.3f}{a:>11.3f}{ra:>7.2f}{b:>9.3f}{rb:>7.2f}"
                          f"{note}")
                summary.append((f"DP{dp} {variant}", cells))
                if m.get("segment") is not None:
                    print(f"  step boundary, last backward to the next step's first lookup "
                          f"(wall time): measured {m['segment']:.4f} s, predicted "
                          f"{with_rows['segment']:.4f} s "
                          f"({with_rows['segment'] / m['segment']:.2f} x)")
    print("\n" + markdown_table(summary))
    print(f"\nworst |predicted/measured - 1| over the major parts (measured rows): "
          f"{worst:.0%}; load average "
          f"{os.getloadavg()[0]:.1f} at end (this machine's 2 cores are shared)")


def markdown_table(summary: list[tuple[str, dict]]) -> str:
    """Per variant and part: measured seconds and predicted / measured (from the measured
    rows); minor parts in parentheses."""
    parts = [p for p in PARTS if any(p in cells for _, cells in summary)]
    lines = ["| variant | " + " | ".join(parts) + " |", "|---" * (len(parts) + 1) + "|"]
    for name, cells in summary:
        row = []
        for part in parts:
            if part not in cells:
                row.append("-")
                continue
            got, ratio, minor = cells[part]
            text = f"{got:.3f} s, {ratio:.2f}"
            row.append(f"({text})" if minor else text)
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
