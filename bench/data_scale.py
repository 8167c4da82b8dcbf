"""The training data path at scale: measured on synthetic prefixes of growing size, fitted
per element, predicted for every stage recipe at the size its data recipe names.

    python bench/data_scale.py [--sizes 1e6 4e6 16e6] [--cpus-per-node 32]

Each prefix has a real `.idx` (documents of ~1,114 tokens on average, OLMo-Mix's) and a
sparse `.bin` (no disk). Measured, each in a fresh process:

- the cold build of the cache (data/sample_cache.py, as tools/build_data_cache.py does it)
  at every size and two sequence lengths: CPU seconds, peak memory and bytes written,
  fitted as `a x documents + b x samples`;
- a blend's indices, side by side in one run: ours (data/blend.py) and megatron-core's
  `build_blending_indices`, of one prefix and of the 1T stage's 195, each written to its
  files and synced as a build does: nanoseconds per sample, and ours at 195 over ours at 1;
- a rank's start with the cache present, the page cache dropped first (cold), through the
  trainer's entry points with every check: prefix sets of 1 to 256 prefixes, time, the
  bytes of `.bin` and `.idx` it brought into memory, its anonymous memory, fitted as
  `c + d x prefixes`;
- a 1-rank start on 64 prefixes of 8 MB of real token ids (sampled, not a set), cold: the
  bytes of the `.bin` files in memory after its first 4 steps' batches;
- a rank's batch of a 1B step (16 x 2,049 tokens) from a real token file, page cache warm
  and cold, with and without MADV_RANDOM.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import re
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

logging.getLogger("megatron").setLevel(logging.ERROR)  # "a BlendedDataset for a single ..."

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megatron_stem.config import DataConfig, DataSource, ModelConfig, Recipe, TrainConfig  # noqa: E402
from megatron_stem.data import blend, sample_cache  # noqa: E402
from megatron_stem.data.indexed import write_index  # noqa: E402
from megatron_stem.data.prefix_sets import MANIFEST  # noqa: E402
from megatron_stem.runtime import page_cache  # noqa: E402

MEAN_TOKENS = 1114  # OLMo-Mix-1124: ~3.9T tokens in ~3.5B documents
SHARE = 0.26  # the 1T stage reads ~26% of an epoch of OLMo-Mix
VOCAB = 128256
TOKENIZER = SimpleNamespace(eod=0, pad=-1, vocab_size=VOCAB,
                            unique_identifiers={"class": "data-scale-bench"})
RANKS = 32  # the 1B stages' 4 x 8 GPUs: each rank's share of a 512-sequence step is 16


def synthetic_prefix(prefix: str, documents: int, seed: int = 0) -> int:
    """A prefix of `documents` documents with a real .idx and a sparse .bin; tokens."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 2 * MEAN_TOKENS, documents, dtype=np.int32)
    write_index(prefix, np.int32, lengths, sync=False)
    tokens = int(lengths.sum(dtype=np.int64))
    with open(prefix + ".bin", "wb") as f:
        f.truncate(tokens * 4)
    return tokens


def synthetic_set(folder: str, count: int, documents: int) -> int:
    """A prefix set of `count` synthetic prefixes and its manifest (largest ids recorded,
    as preprocessing records them); its tokens."""
    os.makedirs(folder)
    entries = []
    for i in range(count):
        name = f"00000-{i:05d}"
        tokens = synthetic_prefix(os.path.join(folder, name), documents, seed=i)
        entries.append({"name": name, "documents": documents, "tokens": tokens,
                        "max_token_id": 0})
    Path(folder, MANIFEST).write_text(json.dumps({"format": 1, "prefixes": entries}))
    return sum(e["tokens"] for e in entries)


def make_recipe(entries: list[str], cache: str, seq: int, samples: int) -> Recipe:
    return Recipe(
        model=ModelConfig(vocab_size=VOCAB, seq_length=seq, hidden_size=64, num_layers=1,
                          num_attention_heads=1, ffn_hidden_size=64),
        data=DataConfig(sources=[DataSource(e, 1.0) for e in entries], split="998,2,0",
                        cache_dir=cache),
        train=TrainConfig(steps=max(1, samples // 512), global_batch_size=512,
                          micro_batch_size=4, eval_iters=20))


def _in_child(fn, *args):
    """fn(*args) in a forked process: (its result, its peak RSS in bytes)."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()

    def target():
        result = fn(*args)
        child.send((result, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))

    process = ctx.Process(target=target)
    process.start()
    out = parent.recv()
    process.join()
    return out


def _anon_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def _plans(recipe: Recipe):
    from megatron_stem.training.batches import Samples, plans

    return plans(recipe, TOKENIZER, Samples.of(recipe, RANKS))


def _build(recipe: Recipe) -> dict:
    run_plans = list(_plans(recipe).values())
    start, cpu = time.perf_counter(), time.process_time()
    sample_cache.build(run_plans)
    return {"seconds": time.perf_counter() - start, "cpu": time.process_time() - cpu}


def _fit(rows: list[tuple[float, float]], values: list[float]) -> tuple[float, float]:
    """Least squares `value = a x rows[i][0] + b x rows[i][1]`, both >= 0."""
    a, b = np.linalg.lstsq(np.array(rows, dtype=float), np.array(values, dtype=float),
                           rcond=None)[0]
    return max(a, 0.0), max(b, 0.0)


def measure_build(sizes: list[int], work: str) -> dict:
    """Cold builds at every size and two sequence lengths (which moves samples against
    documents, so the fit can tell them apart)."""
    points = []
    for n in sizes:
        prefix = os.path.join(work, f"n{n}")
        tokens = synthetic_prefix(prefix, n)
        for seq in (2048, 8192):
            cache = os.path.join(work, f"cache-{n}-{seq}")
            epoch = tokens // seq
            result, peak = _in_child(_build, make_recipe([prefix], cache, seq, int(SHARE * epoch)))
            samples = epoch + int(SHARE * epoch)  # its epoch's sample index, and the blend
            points.append({"documents": n, "samples": samples, "seq": seq, **result,
                           "peak": peak, "cache": sample_cache.cache_bytes(cache)})
            print(f"  {n:>12,} documents, seq {seq:>5}: build {result['cpu']:7.2f} s CPU, "
                  f"peak {peak / 1e9:6.2f} GB, cache {points[-1]['cache'] / 1e9:6.2f} GB",
                  flush=True)
    base = _in_child(lambda: 0)[1]  # a forked process's own RSS before building
    rows = [(p["documents"], p["samples"]) for p in points]
    return {"points": points, "seconds": _fit(rows, [p["cpu"] for p in points]),
            "peak": _fit(rows, [max(0, p["peak"] - base) for p in points]),
            "cache": _fit(rows, [p["cache"] for p in points])}


# -- the blend -------------------------------------------------------------------------------


def stage_weights(prefixes: int = 195, seed: int = 0) -> np.ndarray:
    """A prefix set's weights: prefixes of 20B tokens, but each array task's last one."""
    rng = np.random.default_rng(seed)
    tokens = rng.uniform(19.5e9, 20e9, prefixes)
    tokens[rng.choice(prefixes, prefixes // 3, replace=False)] = rng.uniform(
        0.5e9, 20e9, prefixes // 3)
    return tokens / tokens.sum()


def _blend_files(work: str, weights: np.ndarray, size: int, ours: bool, workers: int) -> float:
    """A blend's two index files, computed, written and synced as a build does: seconds of
    CPU on one worker (other jobs on a shared machine inflate wall time, not CPU time),
    else of wall time."""
    from megatron.core.datasets import helpers

    paths = [os.path.join(work, f"blend-{name}.npy") for name in ("index", "sample")]
    clock = time.process_time if workers == 1 else time.perf_counter
    start = clock()
    index, sample = (np.lib.format.open_memmap(path, "w+", dtype, (size,))
                     for path, dtype in zip(paths, (np.int16, np.int64)))
    if ours:
        blend.blending_indices(weights, index, sample, workers)
    else:
        helpers.build_blending_indices(index, sample, weights, len(weights), size, False)
    for array, path in zip((index, sample), paths):
        array.flush()
        page_cache.drop(path)  # synced
    seconds = clock() - start
    del index, sample
    for path in paths:
        os.remove(path)
    return seconds


def measure_blend(work: str, size: int, repeats: int = 3) -> dict:
    """ns per sample of a blend of 1 and of 195 prefixes, ours (on one CPU, in CPU time,
    and on every one, in wall time) and megatron's (CPU time), interleaved; the median of
    `repeats`."""
    blend.kernel()  # compiled before timing
    cpus = len(os.sched_getaffinity(0))
    ways = {"ours, 1 CPU": (True, 1), f"ours, {cpus} CPUs": (True, cpus),
            "megatron's": (False, 1)}
    times = {(way, p): [] for way in ways for p in (1, 195)}
    for _ in range(repeats):
        for p, weights in ((1, np.ones(1)), (195, stage_weights())):
            for way, (ours, workers) in ways.items():
                times[way, p].append(_blend_files(work, weights, size, ours, workers))
    out = {key: statistics.median(t) / size * 1e9 for key, t in times.items()}
    for way in ways:
        print(f"  {way:>15}: 1 prefix {out[way, 1]:6.1f} ns/sample, 195 prefixes "
              f"{out[way, 195]:6.1f} ns/sample: {out[way, 195] / out[way, 1]:.2f}x", flush=True)
    return {"ns": out, "ways": list(ways), "cpus": cpus}


# -- a rank's start ----------------------------------------------------------------------------


def _data_files(*folders: str) -> list[str]:
    return [str(p) for folder in folders for p in Path(folder).rglob("*")
            if p.is_file() and p.suffix in (".bin", ".idx", ".npy")]


def _cold(files: list[str]) -> None:
    for path in files:
        page_cache.drop(path)


def _rank_start(recipe: Recipe, steps: int = 1) -> dict:
    """What a rank does with its data before its first step (training/loop.py: the checks,
    `_data`), then `steps` steps' batches; time and anonymous memory."""
    import torch

    from megatron_stem.training.batches import (Samples, StepBatches, check_training_data,
                                                check_validation_sets, load_datasets, plans)

    anon = _anon_bytes()
    start = time.perf_counter()
    check_training_data(recipe.data, VOCAB)
    check_validation_sets(recipe.data, VOCAB)
    samples = Samples.of(recipe, RANKS)
    run_plans = plans(recipe, TOKENIZER, samples)
    sample_cache.prepare(list(run_plans.values()), 0, "tools/build_data_cache.py")
    train, _ = load_datasets(run_plans, True)
    batches = StepBatches(train, 4, 512, 0, RANKS, torch.device("cpu"))
    for step in range(steps):
        batches.host(step)
    return {"seconds": time.perf_counter() - start, "anon": _anon_bytes() - anon}


def measure_start(work: str, counts=(1, 16, 64, 195, 256), documents=20_000) -> dict:
    """A rank's cold start over prefix sets of growing count."""
    points = []
    for count in counts:
        folder = os.path.join(work, f"set{count}")
        tokens = synthetic_set(folder, count, documents)
        cache = os.path.join(work, f"cache-set{count}")
        recipe = make_recipe([folder], cache, 2048, int(SHARE * tokens / 2048))
        _in_child(_build, recipe)
        files = _data_files(folder, cache)
        _cold(files)
        result, _ = _in_child(_rank_start, recipe)
        read = {suffix: sum(page_cache.resident(f) for f in files if f.endswith(suffix))
                for suffix in (".bin", ".idx", ".npy")}
        points.append({"prefixes": count, **result, "read": read})
        print(f"  {count:>3} prefixes: start {result['seconds']:.3f} s, read "
              + ", ".join(f"{s} {b / 1e6:.2f} MB" for s, b in read.items())
              + f", anonymous memory +{result['anon'] / 1e6:.1f} MB", flush=True)
    rows = [(1, p["prefixes"]) for p in points]
    return {"points": points, "seconds": _fit(rows, [p["seconds"] for p in points]),
            "anon": _fit(rows, [p["anon"] for p in points])}


def real_prefix(prefix: str, megabytes: float, seed: int) -> int:
    """A prefix of real random int32 ids, `megabytes` of them, documents of ~1,114 tokens."""
    rng = np.random.default_rng(seed)
    tokens = int(megabytes * 1e6 / 4)
    lengths = rng.integers(1, 2 * MEAN_TOKENS, tokens // MEAN_TOKENS + 2, dtype=np.int32)
    lengths = lengths[:np.searchsorted(np.cumsum(lengths), tokens)]
    lengths[-1] += tokens - int(lengths.sum())
    with open(prefix + ".bin", "wb") as f:
        f.write(rng.integers(1, VOCAB, tokens, dtype=np.int32))
    write_index(prefix, np.int32, lengths)
    return tokens


def measure_residency(work: str, prefixes: int = 64, megabytes: float = 8.0) -> dict:
    """A 1-rank start on `prefixes` prefixes of real ids (each sampled: not a set), cold:
    the `.bin` bytes in memory after its first 4 steps' batches."""
    folder = os.path.join(work, "real64")
    os.makedirs(folder)
    entries = [os.path.join(folder, f"p{i:02d}") for i in range(prefixes)]
    tokens = sum(real_prefix(e, megabytes, seed=i) for i, e in enumerate(entries))
    cache = os.path.join(work, "cache-real64")
    recipe = make_recipe(entries, cache, 2048, tokens // 2048 // 2)
    _in_child(_build, recipe)
    bins = [e + ".bin" for e in entries]
    _cold(_data_files(folder, cache))
    result, _ = _in_child(_rank_start, recipe, 4)
    read = sum(page_cache.resident(b) for b in bins)
    total = sum(os.path.getsize(b) for b in bins)
    print(f"  {prefixes} prefixes of {megabytes:g} MB: start and 4 steps' batches "
          f"{result['seconds']:.2f} s, {read / 2**20:.1f} MiB of the {total / 2**20:.0f} MiB "
          "of .bin brought into memory", flush=True)
    return {"read": read, "total": total, "seconds": result["seconds"]}


def measure_batches(work: str, gigabytes: float, steps: int = 8) -> dict:
    """A rank's batch of a 1B step (16 x 2,049 tokens of a 512-sequence step on 32 ranks)
    from a real token file: warm, and cold (its pages dropped before each step), with the
    mapping's read-ahead as the kernel sets it and with MADV_RANDOM."""
    import torch

    from megatron_stem.training.batches import StepBatches, load_datasets

    prefix = os.path.join(work, "real")
    tokens = real_prefix(prefix, gigabytes * 1e3, seed=1)
    recipe = make_recipe([prefix], os.path.join(work, "cache-real"), 2048,
                         tokens // 2048 // 2)
    _in_child(_build, recipe)
    out = {}
    advise = sample_cache._read_randomly
    for label, randomly in (("read-ahead", False), ("MADV_RANDOM", True)):
        sample_cache._read_randomly = advise if randomly else (lambda indexed: None)
        train, _ = load_datasets(_plans(recipe), True)
        batches = StepBatches(train, 4, 512, 0, RANKS, torch.device("cpu"))
        for cold in (False, True):
            times = []
            for step in range(1, steps + 1):
                if cold:
                    page_cache.drop(prefix + ".bin")
                start = time.perf_counter()
                batches.host(step)
                times.append(time.perf_counter() - start)
            out[f"{label}, {'cold' if cold else 'warm'}"] = statistics.median(times)
    sample_cache._read_randomly = advise
    return out


# -- predictions at the recipes' scale ---------------------------------------------------------


def sbatch_ranks(recipe_name: str) -> int | None:
    for script in (ROOT / "slurm").glob("*.sbatch"):
        text = script.read_text()
        if f"recipes/{recipe_name}.yaml}}" in text:
            nodes = re.search(r"#SBATCH --nodes=(\d+)", text)
            gpus = re.search(r"#SBATCH --gpus-per-node=(\d+)", text)
            if nodes and gpus:
                return int(nodes[1]) * int(gpus[1])
    return None


def predict(fits: dict, cpus: int, batch_seconds: float, array_tasks: int) -> list[str]:
    from megatron_stem.config import load_recipe

    lines = []
    (sec_doc, sec_sample), (peak_doc, peak_sample) = fits["build"]["seconds"], fits["build"]["peak"]
    cache_doc, cache_sample = fits["build"]["cache"]
    start_c, start_per = fits["start"]["seconds"]
    anon_c, anon_per = fits["start"]["anon"]
    blend_s = fits["blend"]["ns"]["ours, 1 CPU", 195] * 1e-9  # a sample, one CPU
    for path in sorted((ROOT / "recipes").glob("*_1b_*.yaml")):
        r = load_recipe(path)
        if not r.data.sources:
            continue
        known = [s for s in r.data.sources if s.tokens and s.documents]
        if len(known) < len(r.data.sources):
            lines.append(f"{path.stem}: sizes not named for "
                         f"{', '.join(s.prefix for s in r.data.sources if s not in known)}")
            continue
        ranks = sbatch_ranks(path.stem) or RANKS
        seq, samples = r.model.seq_length, r.train.steps * r.train.global_batch_size
        tasks, blend_samples, cache = [], samples, 0.0
        for share in sample_cache.source_shares(known, seq, samples, array_tasks):
            docs, smp = share.documents, share.samples
            tasks += [(sec_doc * docs + sec_sample * smp, peak_doc * docs + peak_sample * smp)] * share.prefixes
            cache += share.prefixes * (cache_doc * docs + cache_sample * smp)
        cache += cache_sample * blend_samples
        work = sum(t for t, _ in tasks)
        indexing = max(work / cpus, max(t for t, _ in tasks))
        blending = blend_s * samples / cpus
        build_peak = sum(sorted((m for _, m in tasks), reverse=True)[:cpus])
        build_peak = max(build_peak, peak_sample * samples)
        start = start_c + start_per * len(tasks)
        anon = anon_c + anon_per * len(tasks)
        lines.append(
            f"{path.stem}: {sum(s.documents for s in known):,.0f} documents, "
            f"{sum(s.tokens for s in known) / 1e12:.2f}T tokens in {len(tasks)} prefixes, "
            f"{ranks} ranks: cache build {(indexing + blending) / 60:.1f} min on one "
            f"{cpus}-CPU node ({indexing / 60:.1f} min indexing the prefixes, "
            f"{blending:.0f} s blending {samples / 1e6:.0f}M samples; peak "
            f"{build_peak / 1e9:.1f} GB), cache {cache / 1e9:.0f} GB; with the cache, a "
            f"rank's cold start {start:.1f} s, every check included (no rank waits for "
            f"another), {anon / 1e6:.0f} MB of data memory per rank; a step's batch "
            f"{batch_seconds * 1e3:.1f} ms, read while the previous step computes")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[1e6, 4e6, 16e6],
                    help="documents per synthetic prefix")
    ap.add_argument("--cpus-per-node", type=int, default=32,
                    help="CPUs of the node that builds the cache")
    ap.add_argument("--array-tasks", type=int, default=64,
                    help="tasks of the array that tokenizes each source (the README's for "
                         "OLMo-Mix): each task's last prefix is short")
    ap.add_argument("--blend-samples", type=float, default=20e6,
                    help="samples of the blends timed side by side")
    ap.add_argument("--real-gb", type=float, default=1.0,
                    help="size of the real token file the batch times read")
    ap.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.work) as work:
        print("cold build of the cache, one process:")
        build = measure_build([int(n) for n in args.sizes], work)
        print("a blend's indices, computed, written and synced, side by side:")
        blends = measure_blend(work, int(args.blend_samples))
        print("a rank's start with the cache present, cold, every check included:")
        start = measure_start(work)
        print("what a 1-rank start reads of real token files, cold:")
        measure_residency(work)
        print("a rank's batch of a 1B step:")
        batches = measure_batches(work, args.real_gb)
    for label, seconds in batches.items():
        print(f"  {label:>22}: {seconds * 1e3:8.2f} ms")
    ratio = batches["read-ahead, cold"] / batches["MADV_RANDOM, cold"]
    print(f"  cold, read-ahead / MADV_RANDOM: {ratio:.1f}x")
    (sd, ss), (pd, ps), (cd, cs) = build["seconds"], build["peak"], build["cache"]
    print(f"fit: build {sd * 1e6:.3f} us/document + {ss * 1e6:.3f} us/sample (CPU), "
          f"peak {pd:.1f} B/document + {ps:.1f} B/sample, cache {cd:.1f} B/document + "
          f"{cs:.1f} B/sample; blend {blends['ns']['ours, 1 CPU', 195]:.1f} ns/sample on one "
          f"CPU; start {start['seconds'][0]:.3f} s + {start['seconds'][1] * 1e3:.2f} "
          f"ms/prefix, anonymous memory {start['anon'][0] / 1e6:.1f} MB + "
          f"{start['anon'][1] / 1e3:.0f} kB/prefix")
    print("predicted at the recipes' scale:")
    for line in predict({"build": build, "start": start, "blend": blends},
                        args.cpus_per_node, batches["MADV_RANDOM, cold"],
                        args.array_tasks):
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
