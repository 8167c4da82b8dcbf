"""The training data path at scale: measured on synthetic prefixes of growing size, fitted
per element, predicted for every stage recipe at the size its data recipe names.

    python bench/data_scale.py [--sizes 1e6 4e6 16e6] [--cpus-per-node 32]

Each prefix has a real `.idx` (documents of ~1,114 tokens on average, OLMo-Mix's) and a
sparse `.bin` (no disk). For each size and two sequence lengths it measures, each in a
fresh process: the cold build of the cache (data/sample_cache.py, as
tools/build_data_cache.py does it: CPU seconds, peak memory, bytes written) and a rank's
warm start with the cache present (time, anonymous memory). It fits build seconds, peak
bytes and cache bytes as `a x documents + b x samples`, the start as `c + d x prefixes`
(on prefix sets of growing count), and times a rank's batch of a 1B step (16 x 2,049
tokens) from a real token file, page cache warm and cold, with and without MADV_RANDOM.
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
from megatron_stem.data.indexed import write_index  # noqa: E402
from megatron_stem.data.prefix_sets import MANIFEST  # noqa: E402
from megatron_stem.data import sample_cache  # noqa: E402

MEAN_TOKENS = 1114  # OLMo-Mix-1124: ~3.9T tokens in ~3.5B documents
SHARE = 0.26  # the 1T stage reads ~26% of an epoch of OLMo-Mix
TOKENIZER = SimpleNamespace(eod=0, pad=-1, vocab_size=128256,
                            unique_identifiers={"class": "data-scale-bench"})


def synthetic_prefix(prefix: str, documents: int, seed: int = 0) -> int:
    """A prefix of `documents` documents with a real .idx and a sparse .bin; tokens."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 2 * MEAN_TOKENS, documents, dtype=np.int32)
    write_index(prefix, np.int32, lengths, sync=False)
    tokens = int(lengths.sum(dtype=np.int64))
    with open(prefix + ".bin", "wb") as f:
        f.truncate(tokens * 4)
    return tokens


def make_recipe(entries: list[str], cache: str, seq: int, samples: int) -> Recipe:
    return Recipe(
        model=ModelConfig(vocab_size=128256, seq_length=seq, hidden_size=64, num_layers=1,
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


def _build(recipe: Recipe) -> dict:
    from megatron_stem.training.batches import Samples, plans

    run_plans = list(plans(recipe, TOKENIZER, Samples.of(recipe, 32)).values())
    start, cpu = time.perf_counter(), time.process_time()
    sample_cache.build(run_plans)
    return {"seconds": time.perf_counter() - start, "cpu": time.process_time() - cpu}


def _start(recipe: Recipe) -> dict:
    """A rank's start with the cache present: plans, datasets, its first batch."""
    import torch

    from megatron_stem.training.batches import Samples, StepBatches, load_datasets, plans

    anon = _anon_bytes()
    start = time.perf_counter()
    train, _ = load_datasets(plans(recipe, TOKENIZER, Samples.of(recipe, 32)), True)
    StepBatches(train, 4, 512, 0, 32, torch.device("cpu")).host(0)
    return {"seconds": time.perf_counter() - start, "anon": _anon_bytes() - anon}


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


def measure_start(work: str, counts=(1, 8, 32), documents=20_000) -> dict:
    """A rank's warm start over prefix sets of growing count."""
    points = []
    for count in counts:
        folder = os.path.join(work, f"set{count}")
        os.makedirs(folder)
        entries = []
        for i in range(count):
            name = f"00000-{i:05d}"
            tokens = synthetic_prefix(os.path.join(folder, name), documents, seed=i)
            entries.append({"name": name, "documents": documents, "tokens": tokens})
        Path(folder, MANIFEST).write_text(json.dumps({"format": 1, "prefixes": entries}))
        recipe = make_recipe([folder], os.path.join(work, f"cache-set{count}"), 2048,
                             int(SHARE * count * documents * MEAN_TOKENS / 2048))
        _in_child(_build, recipe)
        result, _ = _in_child(_start, recipe)
        points.append({"prefixes": count, **result})
        print(f"  {count:>3} prefixes: start {result['seconds']:.3f} s, anonymous memory "
              f"+{result['anon'] / 1e6:.1f} MB", flush=True)
    rows = [(1, p["prefixes"]) for p in points]
    return {"points": points, "seconds": _fit(rows, [p["seconds"] for p in points]),
            "anon": _fit(rows, [p["anon"] for p in points])}


def _drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def measure_batches(work: str, gigabytes: float, steps: int = 8) -> dict:
    """A rank's batch of a 1B step (16 x 2,049 tokens of a 512-sequence step on 32 ranks)
    from a real token file: warm, and cold (its pages dropped before each step), with the
    mapping's read-ahead as the kernel sets it and with MADV_RANDOM."""
    import torch

    from megatron_stem.training.batches import Samples, StepBatches, load_datasets, plans

    prefix = os.path.join(work, "real")
    rng = np.random.default_rng(1)
    documents = int(gigabytes * 1e9 / 4 / MEAN_TOKENS)
    lengths = rng.integers(1, 2 * MEAN_TOKENS, documents, dtype=np.int32)
    with open(prefix + ".bin", "wb") as f:
        for chunk in np.array_split(np.arange(documents), 64):
            f.write(rng.integers(1, 128256, int(lengths[chunk].sum()), dtype=np.int32))
    write_index(prefix, np.int32, lengths)
    recipe = make_recipe([prefix], os.path.join(work, "cache-real"), 2048,
                         int(lengths.sum(dtype=np.int64)) // 2048 // 2)
    _in_child(_build, recipe)
    out = {}
    advise = sample_cache._read_randomly
    for label, randomly in (("read-ahead", False), ("MADV_RANDOM", True)):
        sample_cache._read_randomly = advise if randomly else (lambda low: None)
        train, _ = load_datasets(plans(recipe, TOKENIZER, Samples.of(recipe, 32)), True)
        batches = StepBatches(train, 4, 512, 0, 32, torch.device("cpu"))
        for cold in (False, True):
            times = []
            for step in range(1, steps + 1):
                if cold:
                    _drop_cache(prefix + ".bin")
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


def predict(fits: dict, cpus: int, batch_seconds: float) -> list[str]:
    from megatron_stem.config import load_recipe

    lines = []
    (sec_doc, sec_sample), (peak_doc, peak_sample) = fits["build"]["seconds"], fits["build"]["peak"]
    cache_doc, cache_sample = fits["build"]["cache"]
    start_c, start_per = fits["start"]["seconds"]
    anon_c, anon_per = fits["start"]["anon"]
    for path in sorted((ROOT / "recipes").glob("*_1b_*.yaml")):
        r = load_recipe(path)
        if not r.data.sources:
            continue
        known = [s for s in r.data.sources if s.tokens and s.documents]
        if len(known) < len(r.data.sources):
            lines.append(f"{path.stem}: sizes not named for "
                         f"{', '.join(s.prefix for s in r.data.sources if s not in known)}")
            continue
        ranks = sbatch_ranks(path.stem) or 32
        seq, samples = r.model.seq_length, r.train.steps * r.train.global_batch_size
        tasks, blend_samples, cache = [], samples, 0.0
        for share in sample_cache.source_shares(known, seq, samples):
            docs, smp = share.documents, share.samples
            tasks += [(sec_doc * docs + sec_sample * smp, peak_doc * docs + peak_sample * smp)] * share.prefixes
            cache += share.prefixes * (cache_doc * docs + cache_sample * smp)
        cache += cache_sample * blend_samples
        work = sum(t for t, _ in tasks)
        build = max(work / cpus, max(t for t, _ in tasks)) + sec_sample * blend_samples
        build_peak = sum(sorted((m for _, m in tasks), reverse=True)[:cpus])
        build_peak = max(build_peak, peak_sample * blend_samples)
        start = start_c + start_per * len(tasks)
        anon = anon_c + anon_per * len(tasks)
        lines.append(
            f"{path.stem}: {sum(s.documents for s in known):,.0f} documents, "
            f"{sum(s.tokens for s in known) / 1e12:.2f}T tokens in {len(tasks)} prefixes, "
            f"{ranks} ranks: cache build {build / 60:.1f} min on one {cpus}-CPU node "
            f"(peak {build_peak / 1e9:.1f} GB), cache {cache / 1e9:.0f} GB; with the cache, "
            f"launch to first batch {start:.1f} s per rank (no rank waits for another), "
            f"{anon / 1e6:.0f} MB of data memory per rank; a step's batch "
            f"{batch_seconds * 1e3:.1f} ms, read while the previous step computes")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[1e6, 4e6, 16e6],
                    help="documents per synthetic prefix")
    ap.add_argument("--cpus-per-node", type=int, default=32,
                    help="CPUs of the node that builds the cache")
    ap.add_argument("--real-gb", type=float, default=1.0,
                    help="size of the real token file the batch times read")
    ap.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.work) as work:
        print("cold build of the cache, one process:")
        build = measure_build([int(n) for n in args.sizes], work)
        print("a rank's start with the cache present:")
        start = measure_start(work)
        print("a rank's batch of a 1B step:")
        batches = measure_batches(work, args.real_gb)
    for label, seconds in batches.items():
        print(f"  {label:>22}: {seconds * 1e3:8.2f} ms")
    ratio = batches["read-ahead, cold"] / batches["MADV_RANDOM, cold"]
    print(f"  cold, read-ahead / MADV_RANDOM: {ratio:.1f}x")
    (sd, ss), (pd, ps), (cd, cs) = build["seconds"], build["peak"], build["cache"]
    print(f"fit: build {sd * 1e6:.3f} us/document + {ss * 1e6:.3f} us/sample (CPU), "
          f"peak {pd:.1f} B/document + {ps:.1f} B/sample, cache {cd:.1f} B/document + "
          f"{cs:.1f} B/sample; start {start['seconds'][0]:.3f} s + "
          f"{start['seconds'][1] * 1e3:.2f} ms/prefix, anonymous memory "
          f"{start['anon'][0] / 1e6:.1f} MB + {start['anon'][1] / 1e3:.0f} kB/prefix")
    print("predicted at the recipes' scale:")
    for line in predict({"build": build, "start": start}, args.cpus_per_node,
                        batches["MADV_RANDOM, cold"]):
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
