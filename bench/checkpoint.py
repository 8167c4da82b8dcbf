"""Checkpoints at N ranks through the trainer, this code against the code before it: what
each rank reads at resume, holds in host memory and waits at a save, at growing sizes,
fitted and carried to 32 ranks and the 1B recipe's checkpoint.

    python bench/checkpoint.py [--ranks 4] [--hidden 128,256,384,512] [--before REV|none]
                               [--dir DIR] [--json FILE]

Each size is recipes/tiny_cpu.yaml widened (hidden size H, FFN 3H, vocabulary 4,096, two
STEM tables; fp32, TP1, DP = `--ranks`, `train.async_save` as the 1B recipes), trained on
synthetic tokens. For this checkout and for `--before` (default: the revision before
saves stopped gathering, read from git into a temporary folder; `none` skips it), three
trainer runs under torchrun:

1. two steps, the checkpoint saved at the last: per rank, the time the step waits at the
   save (until the background writer starts), the time the commit takes, and the peak host
   memory above the rank's memory before the save (VmHWM reset as the save starts: the
   host copy, the gathered states, the writer's buffers);
2. a resume from it under strace: the bytes each rank reads from the checkpoint's files
   (read, pread64, readv, preadv), load and checksum verification together;
3. the same resume without strace: the time until the optimizer states are in.

Then a line per metric is fitted over the sizes against the quantity the design says it
grows with (the checkpoint's bytes, or a rank's share of them: what it writes, or the
dense optimizer state that the code before gathered on every rank) and evaluated at 32
ranks for the 1B recipe's checkpoint (recipes/stem_1b.yaml: bf16 weights, fp32 masters and
moments, 93 GB). On a CPU the times are a shared machine's: read the ratios.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEFORE = "f2cd9c7"  # the last revision whose saves gather the dense states on every rank
VOCAB = 4096
STEPS = 2  # the save is at the last step: the writer runs and commits within the save call
# One file per thread (`-ff`: `<prefix>.<thread id>`), so no call is split across lines.
STRACE = ["strace", "-ff", "-qq", "-s", "0", "-y", "--seccomp-bpf",
          "-e", "trace=read,pread64,readv,preadv,preadv2"]
READ = re.compile(r"^\w+\(\d+<([^>]*)>.*\)\s+=\s+(\d+)$")
TARGET_RANKS = 32


# -- what every rank runs (under torchrun) --------------------------------------------

def _rss(field: str) -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", status)[1]) << 10


def _timed(cls, name: str, record: dict, key: str, after=None):
    """Wrap `cls.name` to add its duration (s) to `record[key]`; `after(result)` follows."""
    original = getattr(cls, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = original(*args, **kwargs)
        record[key] = record.get(key, 0.0) + time.perf_counter() - start
        if after is not None:
            after(result)
        return result
    setattr(cls, name, wrapper)


def rank_side(args) -> None:
    """One rank of a run: the trainer with the save or resume instrumented."""
    import ctypes
    import threading

    import torch.distributed as dist

    from megatron_stem.checkpoint.background import BackgroundSave
    from megatron_stem.checkpoint.checkpointer import Checkpointer
    from megatron_stem.checkpoint.commit import Writer
    from megatron_stem.config import load_recipe
    from megatron_stem.training.loop import run

    record = {"rank": int(os.environ["RANK"]), "pid": os.getpid()}

    def dump():
        record["threads"] = [t.native_id for t in threading.enumerate()]
        Path(args.out, f"rank{record['rank']}.json").write_text(json.dumps(record))

    if args.phase == "save":
        save, start = Checkpointer.save, BackgroundSave.start

        def measured(self, step, force=False):
            ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed memory back: RSS is what is held
            before, entry = _rss("VmRSS"), time.perf_counter()
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here
            record["entry"] = entry
            saved = save(self, step, force)
            if saved:
                record.update(save_s=time.perf_counter() - entry, save_peak=_rss("VmHWM") - before)
            return saved

        def started(self):  # the step waits until the writer runs
            start(self)
            record["wait_s"] = time.perf_counter() - record["entry"]
        Checkpointer.save, BackgroundSave.start = measured, started
        _timed(Writer, "__exit__", record, "commit_s")
    else:
        _timed(Checkpointer, "__init__", record, "find_s")
        _timed(Checkpointer, "load_weights", record, "weights_s")

        def resumed(_):
            dist.barrier()
            dump()
            os._exit(0)  # nothing else to measure: no step, no save
        _timed(Checkpointer, "resume", record, "optimizer_s", after=resumed)

    recipe = load_recipe(ROOT / "recipes" / "tiny_cpu.yaml", recipe_overrides(args))
    run(recipe, _Tokenizer(VOCAB))
    dump()


class _Tokenizer:
    """What megatron's dataset needs of a tokenizer, for pre-tokenized data."""

    def __init__(self, vocab_size: int):
        self.vocab_size, self.eod, self.pad = vocab_size, vocab_size - 1, vocab_size - 2
        self.unique_identifiers = {"class": "bench", "vocab_size": vocab_size}


def recipe_overrides(args) -> list[str]:
    h = args.hidden
    return [f"model.hidden_size={h}", f"model.ffn_hidden_size={3 * h}",
            f"model.vocab_size={VOCAB}", f"data.prefixes=[{args.data}]",
            "train.micro_batch_size=2", f"train.global_batch_size={2 * args.ranks}",
            f"train.steps={STEPS + (args.phase != 'save')}", f"train.save_interval={STEPS}",
            "train.eval_interval=1000", "train.log_interval=1000", "train.async_save=true",
            "train.keep_last=0", f"train.save_dir={args.save_dir}"]


# -- the driver -------------------------------------------------------------------------

def synthetic_data(prefix: Path) -> str:
    """Random documents of 64-512 tokens over the vocabulary, as Megatron's .bin/.idx."""
    import numpy as np
    import torch

    import megatron_stem  # noqa: F401 (before megatron-core: its warnings filtered)
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.uint16)
    for _ in range(2000):
        doc = rng.integers(0, VOCAB - 2, rng.integers(64, 512))
        builder.add_document(torch.tensor(np.append(doc, VOCAB - 1)), [len(doc) + 1])
    builder.finalize(str(prefix) + ".idx")
    return str(prefix)


def code_before(rev: str, folder: Path) -> Path:
    """The package as of `rev`, from git, in `folder`."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev,
                              "megatron_stem"], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    return folder


def torchrun(code: Path, ranks: int, flags: list[str], out: Path, traced: Path | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={ranks}", __file__, "--rank-side", "--out", str(out), *flags]
    if traced is not None:
        cmd = [*STRACE, "-o", str(traced), *cmd]
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"a run failed ({' '.join(cmd[-6:])}):\n{proc.stdout[-3000:]}"
                 f"\n{proc.stderr[-3000:]}")


def ranks_of(out: Path) -> list[dict]:
    return sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")),
                  key=lambda r: r["rank"])


def reads_per_rank(trace: Path, folder: Path, ranks: list[dict]) -> list[int]:
    """Bytes each rank's threads read from files under `folder` (strace's `trace`.<tid>)."""
    owner = {tid: r["rank"] for r in ranks for tid in [r["pid"], *r["threads"]]}
    out, inside = [0] * len(ranks), str(folder) + "/"
    for path in trace.parent.glob(trace.name + ".*"):
        read = sum(int(m[2]) for line in path.read_text().splitlines()
                   for m in [READ.match(line)] if m and m[1].startswith(inside))
        tid = int(path.suffix[1:])
        if read and tid not in owner:
            raise RuntimeError(f"thread {tid} of no rank read {read} bytes of {folder}")
        if read:
            out[owner[tid]] += read
    return out


def written_per_rank(folder: Path, ranks: int) -> list[int]:
    """Bytes of the checkpoint each rank wrote: its shard files; rank 0 also the rest."""
    out = [0] * ranks
    for path in folder.rglob("*"):
        if path.is_file():
            writer = re.match(r"__(\d+)_\d+\.distcp$", path.name)
            out[int(writer[1]) if writer else 0] += path.stat().st_size
    return out


def measure(code: Path, hidden: int, ranks: int, data: str, work: Path, times: bool = True
            ) -> dict:
    """One size, one code: the three runs' figures (without `times`, the first two)."""
    save_dir = work / "ckpt"
    flags = ["--hidden", str(hidden), "--ranks", str(ranks), "--data", data,
             "--save-dir", str(save_dir)]
    torchrun(code, ranks, [*flags, "--phase", "save"], work / "save", None)
    ckpt = save_dir / f"iter_{STEPS:07d}"
    saves = ranks_of(work / "save")
    torchrun(code, ranks, [*flags, "--phase", "resume"], work / "traced", work / "strace.txt")
    traced = ranks_of(work / "traced")
    resumes = []
    if times:
        torchrun(code, ranks, [*flags, "--phase", "resume"], work / "resume", None)
        resumes = ranks_of(work / "resume")
    size = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    return {"hidden": hidden, "ranks": ranks, "bytes": size,
            "written": written_per_rank(ckpt, ranks),
            "resume_reads": reads_per_rank(work / "strace.txt", ckpt, traced),
            "resume_s": [r["find_s"] + r["weights_s"] + r["optimizer_s"] for r in resumes] or [0.0],
            "wait_s": [r["wait_s"] for r in saves], "commit_s": [r["commit_s"] for r in saves],
            "save_peak": [r["save_peak"] for r in saves],
            "dense_state": dense_state_bytes(ckpt)}


def dense_state_bytes(ckpt: Path) -> int:
    """The fp32 masters and moments of the dense parameters in a checkpoint: what the code
    before gathered whole on every rank at a save."""
    from math import prod

    from megatron_stem.checkpoint.unpickling import read_metadata

    index = read_metadata(ckpt / "optim" / ".metadata").state_dict_metadata
    return sum(4 * prod(item.size) for key, item in index.items()
               if key.startswith("optimizer.") and ".mlp.table." not in key)


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y = a + b x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


# What each figure grows with, by design: (label, per-run value, predictor, the predictor
# at the 1B recipe's checkpoint on `TARGET_RANKS` ranks).
def metrics(target: dict) -> dict:
    share = target["bytes"] / TARGET_RANKS
    return {
        "resume: reads of the rank that reads most, GB": (lambda m: max(m["resume_reads"]),
                                        {"now": (lambda m: m["bytes"] / m["ranks"], share),
                                         "before": (lambda m: m["bytes"], target["bytes"])}),
        "save: host memory of the rank that holds most, GB": (lambda m: max(m["save_peak"]),
                                             {"now": (lambda m: max(m["written"]), share),
                                              "before": (lambda m: m["dense_state"],
                                                         target["dense_state"])}),
        "save: the step waits, s (CPU)": (lambda m: max(m["wait_s"]),
                                    {"now": (lambda m: max(m["written"]), share),
                                     "before": (lambda m: m["dense_state"],
                                                target["dense_state"])}),
        "commit, s": (lambda m: max(m["commit_s"]),  # now: reads nothing, whatever the size
                      {"now": (lambda m: 0.0, 0.0),
                       "before": (lambda m: max(m["written"]), share)}),
        "resume, s (CPU)": (lambda m: max(m["resume_s"]),
                      {"now": (lambda m: m["bytes"] / m["ranks"], share),
                       "before": (lambda m: m["bytes"], target["bytes"])}),
    }


def one_b() -> dict:
    """The 1B recipe's checkpoint: its bytes and its dense optimizer state."""
    sys.path.insert(0, str(ROOT / "bench"))
    from checkpoint_storage import tensors_1b

    from megatron_stem.config import load_recipe

    dense, table_weights, table_states = tensors_1b(
        load_recipe(ROOT / "recipes" / "stem_1b.yaml"))
    return {"bytes": sum(dense) + sum(table_weights) + sum(table_states),
            "dense_state": sum(size for i, size in enumerate(dense) if i % 4)}


def report(results: dict[str, list[dict]]) -> list[str]:
    """The figures as two Markdown tables: per size measured (each cell this code's figure,
    then the code before's), and fitted to the 1B checkpoint on `TARGET_RANKS` ranks."""
    def cells(values: list[float], form: str) -> str:
        return " / ".join(form.format(v) for v in values)

    target, codes = one_b(), list(results)
    lines = ["| H | checkpoint | resume reads, all ranks | most by one rank | save: host memory, "
             "most of a rank | a rank's share | the step waits | commit | resume |",
             "|---:|---:|---|---|---|---:|---|---|---|"]
    for runs in zip(*results.values()):
        size = runs[0]["bytes"]
        lines.append(
            f"| {runs[0]['hidden']} | {size / 1e6:.0f} MB "
            f"| {cells([sum(m['resume_reads']) / size for m in runs], '{:.2f}')} x "
            f"| {cells([max(m['resume_reads']) / size for m in runs], '{:.2f}')} "
            f"| {cells([max(m['save_peak']) / 1e6 for m in runs], '{:.0f}')} MB "
            f"| {max(runs[0]['written']) / 1e6:.0f} MB "
            f"| {cells([max(m['wait_s']) for m in runs], '{:.2f}')} s "
            f"| {cells([max(m['commit_s']) for m in runs], '{:.2f}')} s "
            f"| {cells([max(m['resume_s']) for m in runs], '{:.1f}')} s |")
    lines += ["", f"| {TARGET_RANKS} ranks, the 1B checkpoint ({target['bytes'] / 1e9:.1f} GB) | "
              + " | ".join(codes) + " |", "|---" + "|---:" * len(codes) + "|"]
    for label, (value, predictors) in metrics(target).items():
        fitted = []
        for code in codes:
            predictor, at = predictors[code]
            runs = results[code]
            a, b = fit([predictor(m) for m in runs], [value(m) for m in runs])
            fitted.append((a + b * at) / (1e9 if "GB" in label else 1.0))
        lines.append(f"| {label} | " + " | ".join(
            f"{v:.2f}" if v < 10 else f"{v:,.0f}" for v in fitted) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4, help="data-parallel ranks (TP1)")
    ap.add_argument("--hidden", default="128,256,384,512",
                    help="hidden sizes to measure, comma-separated (FFN 3x)")
    ap.add_argument("--before", default=BEFORE,
                    help="git revision to compare with, or none (default: %(default)s)")
    ap.add_argument("--dir", default=None, help="where to train and save (default: a "
                    "temporary folder in the current one: put it on checkpoint storage)")
    ap.add_argument("--json", default=None, help="write every figure here as well")
    ap.add_argument("--no-times", action="store_true",
                    help="skip the third run of each (the resume's time): reads and memory only")
    ap.add_argument("--report", default=None, metavar="JSON",
                    help="print the tables of an earlier run's --json, measuring nothing")
    ap.add_argument("--rank-side", action="store_true", help=argparse.SUPPRESS)
    for flag in ("--out", "--data", "--save-dir", "--phase"):
        ap.add_argument(flag, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_side:
        args.hidden = int(args.hidden)
        return rank_side(args)
    if args.report:
        print("\n".join(report(json.loads(Path(args.report).read_text()))))
        return
    if shutil.which("strace") is None:
        sys.exit("strace is needed to count each rank's reads (Debian: apt-get install strace)")
    work = Path(args.dir or tempfile.mkdtemp(prefix="bench_checkpoint_", dir="."))
    work.mkdir(parents=True, exist_ok=True)
    try:
        data = synthetic_data(work / "tokens")
        codes = {"now": ROOT}
        if args.before != "none":
            codes["before"] = code_before(args.before, work / "before")
        results = {code: [] for code in codes}
        for hidden in map(int, args.hidden.split(",")):
            for code, path in codes.items():
                results[code].append(measure(path, hidden, args.ranks, data,
                                             work / f"{code}_{hidden}", not args.no_times))
                shutil.rmtree(work / f"{code}_{hidden}")
                print(f"measured {code} at hidden {hidden}", flush=True)
        print("\n".join(report(results)))
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
