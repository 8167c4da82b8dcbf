"""Host-resident tables on this machine: gather speed, prefetch overlap, hot-row cache.

    python bench/host_tables.py [--parts gather,step,cache] [--vocab 8192 ...]

1. gather: rows of a [vocab, width] fp32 table gathered by `gather_rows` (1..N threads)
   into a staging buffer, GB/s against a plain copy of the same bytes in the same run (the
   memory-bandwidth limit). On a GPU also the copy of the staged rows from pinned memory to
   the device against a plain pinned copy of the same bytes.
2. step: the real trainer step (DeepSpeed engine + table optimizer) with tables `device`
   (rows in place), `host` with prefetch (one micro-batch ahead), `host` staged on demand
   (no overlap); on a CPU the variants take turns step by step (noise from other jobs hits
   them alike); fastest and median step. Overlap efficiency = 1 - (forward's wait with
   prefetch) / (its wait on demand): the share of the staging time hidden behind compute.
3. cache: micro-batches of real text (the shipped GCIDE corpus, SentencePiece ids):
   hit rates of the shipped policy (LFU, aging 0.99 per step) against pure LFU, LRU and a
   static top-k oracle (corpus frequencies), membership changing at step boundaries as
   in training; then training's bytes copied to the device per step through the real
   store (misses + refreshes of cached rows the step updated) against no cache.
"""

import argparse
import collections
import gc
import gzip
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from megatron_stem.config import (ModelConfig, OptimizerConfig, ParallelConfig, Recipe,
                                  TableOptimizerConfig, TableStorageConfig, TrainConfig)
from megatron_stem.model import build_model
from megatron_stem.model.row_cache import RowCache
from megatron_stem.runtime.parallel import destroy_distributed, init_distributed
from megatron_stem.training.loop import train_step
from megatron_stem.training.engine import build_engine
from megatron_stem.tables.host_tables import HostTableStore, gather_rows

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "data_corpus" / "gcide.jsonl.gz"


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def bench_gather(args) -> None:
    table = torch.randn(args.gather_vocab, args.width)
    ids = torch.randperm(args.gather_vocab)[:args.gather_rows].sort().values
    nbytes = ids.numel() * args.width * 4
    src = torch.randn(ids.numel(), args.width)
    out = torch.empty(ids.numel(), args.width)
    memcpy = nbytes / _best(lambda: out.copy_(src), args.repeats) / 1e9
    print(f"gather: {ids.numel()} random rows of a {args.gather_vocab} x {args.width} fp32 "
          f"table ({nbytes / 2**20:.0f} MiB); plain copy of the same bytes {memcpy:.2f} GB/s")
    print(f"{'threads':>8}{'GB/s':>8}{'vs copy':>9}")
    for threads in sorted({1, 2, 4, os.cpu_count() or 1}):
        pool = ThreadPoolExecutor(threads) if threads > 1 else None
        rate = nbytes / _best(lambda: gather_rows(table, ids, out, pool), args.repeats) / 1e9  # noqa: B023
        print(f"{threads:>8}{rate:>8.2f}{rate / memcpy:>9.2f}")
        if pool is not None:
            pool.shutdown()
    if torch.cuda.is_available():
        pinned = torch.empty(ids.numel(), args.width, dtype=torch.bfloat16, pin_memory=True)
        dev = torch.empty_like(pinned, device="cuda")
        h2d = pinned.numel() * 2 / _best(lambda: dev.copy_(pinned, non_blocking=True),
                                         args.repeats) / 1e9
        with ThreadPoolExecutor(args.gather_threads) as pool:
            staged = pinned.numel() * 2 / _best(
                lambda: dev.copy_(_gathered(table, ids, pinned, pool), non_blocking=True),
                args.repeats) / 1e9
        print(f"h2d: pinned bf16 copy {h2d:.1f} GB/s; gather ({args.gather_threads} threads) "
              f"+ copy {staged:.1f} GB/s ({staged / h2d:.2f} of the copy)")


def _gathered(table, ids, pinned, pool):
    gather_rows(table, ids, pinned, pool)
    return pinned


# -- real text ----------------------------------------------------------------------------


def text_ids(vocab: int, tokenizer: str | None) -> torch.Tensor:
    """The corpus as one stream of SentencePiece ids (a `vocab` model trained once here)."""
    import sentencepiece as spm

    if tokenizer is None:
        cache = Path(tempfile.gettempdir()) / "megatron_stem_bench"
        prefix = cache / f"gcide_{vocab}"
        if not Path(f"{prefix}.model").is_file():
            from megatron_stem.data.tokenizer_training import (TokenizerTrainingConfig,
                                                               train_sentencepiece)
            cache.mkdir(exist_ok=True)
            train_sentencepiece(TokenizerTrainingConfig(
                inputs=[str(CORPUS)], output_prefix=str(prefix), vocab_size=vocab,
                max_docs=20000, threads=os.cpu_count() or 1), log=None)
        tokenizer = f"{prefix}.model"
    sp = spm.SentencePieceProcessor(model_file=tokenizer)
    with gzip.open(CORPUS, "rt") as f:
        texts = [json.loads(line)["text"] for line in f]
    ids = [i for piece in sp.encode(texts) for i in piece + [2]]  # 2 = end of document
    return torch.tensor(ids, dtype=torch.long)


def text_microbatches(ids: torch.Tensor, count: int, batch: int, seq: int, seed: int = 0):
    """`count` micro-batches of `batch` random windows of `seq + 1` ids."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seq - 1, (count, batch), generator=g)
    out = []
    for row in starts:
        window = torch.stack([ids[s:s + seq + 1] for s in row.tolist()])
        out.append({"tokens": window[:, :-1].contiguous(), "labels": window[:, 1:].contiguous(),
                    "loss_mask": torch.ones(batch, seq)})
    return out


# -- step time ----------------------------------------------------------------------------


def bench_step(args, ids) -> None:
    model = ModelConfig(hidden_size=args.hidden, num_layers=args.layers,
                        num_attention_heads=args.heads, num_query_groups=args.kv_heads,
                        ffn_hidden_size=args.ffn, vocab_size=args.model_vocab or args.vocab,
                        seq_length=args.seq,
                        stem_layers=args.stem_layers)
    per_step = args.global_batch // args.micro_batch
    data = text_microbatches(ids, per_step * (args.steps + 1), args.micro_batch, args.seq)
    steps = [data[i:i + per_step] for i in range(0, len(data), per_step)]
    if torch.cuda.is_available():
        steps = [[{k: v.cuda() for k, v in mb.items()} for mb in s] for s in steps]
    variants = [("device", "device", 1, 0), ("host, prefetch", "host", 1, 0),
                ("host, on demand", "host", 0, 0)]
    if args.cache_rows:
        variants.append((f"host, prefetch, cache {args.cache_rows}", "host", 1, args.cache_rows))
    def build(placement, lookahead, cache):
        recipe = Recipe(model=model, train=TrainConfig(
            micro_batch_size=args.micro_batch, global_batch_size=args.global_batch,
            dtype=args.dtype), optimizer=OptimizerConfig(tables=TableOptimizerConfig(
                update=args.update, kernel=args.kernel)), tables=TableStorageConfig(
            placement=placement, cache_rows=cache, gather_threads=args.gather_threads))
        torch.manual_seed(0)
        net = build_model(recipe.model, recipe.parallel, tables=recipe.tables)
        engine, tables, update = build_engine(net, recipe)
        if tables.host is not None:
            tables.host.lookahead = lookahead
        return update, tables, []

    def one_step(run, i, mbs):
        update, tables, times = run
        if i == 1:
            tables.host_stats()  # the first step allocates state: not measured
        start = time.perf_counter()
        train_step(update, mbs, 1e-3)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)

    def finish(run):
        _, tables, times = run
        result = (min(times), statistics.median(times), tables.host_stats())
        tables.close()
        return result

    results = {}
    if torch.cuda.is_available():  # one variant at a time: a 1B shape's copies are large
        for name, *variant in variants:
            run = build(*variant)
            for i, mbs in enumerate(steps):
                one_step(run, i, mbs)
            results[name] = finish(run)
            del run
            gc.collect()
            torch.cuda.empty_cache()
    else:  # variants take turns step by step, so load from other jobs hits them alike
        runs = {name: build(*variant) for name, *variant in variants}
        for i, mbs in enumerate(steps):
            for run in runs.values():
                one_step(run, i, mbs)
        results = {name: finish(run) for name, run in runs.items()}
    print(f"step: d={args.hidden} layers={args.layers} stem={args.stem_layers} d_ff={args.ffn} "
          f"vocab={model.vocab_size} {per_step} micro-batches of {args.micro_batch} x {args.seq} "
          f"text tokens, {args.update}, {args.dtype}, {args.steps} steps")
    base = results["device"][0]
    print(f"{'tables':<30}{'s/step min':>11}{'median':>8}{'vs device':>11}{'wait ms/step':>14}"
          f"{'MiB h2d/step':>14}{'hits':>7}")
    for name, (fastest, median, stats) in results.items():
        wait = f"{stats['prefetch_wait_ms']:.1f}" if stats else "-"
        moved = f"{stats['h2d_bytes'] / 2**20:.1f}" if stats else "-"
        hits = f"{stats['cache_hit_rate']:.0%}" if "cache_hit_rate" in stats else "-"
        print(f"{name:<30}{fastest:>11.3f}{median:>8.3f}{fastest / base:>11.3f}{wait:>14}"
              f"{moved:>14}{hits:>7}")
    on_demand = results["host, on demand"][2]["prefetch_wait_ms"]
    prefetch = results["host, prefetch"][2]["prefetch_wait_ms"]
    print(f"overlap efficiency (staging time hidden): {1 - prefetch / max(on_demand, 1e-9):.1%}")


# -- cache --------------------------------------------------------------------------------


def _lfu(vocab, capacity, decay):
    cache = RowCache(vocab, capacity, [1], torch.float32, [torch.device("cpu")], decay)

    def step(mbs):
        hits = total = 0
        for ids in mbs:
            hits += int((cache.slots(ids) >= 0).sum())
            total += ids.numel()
            cache.observe(ids)
        cache.plan()
        return hits, total
    return step


def _lru(capacity):
    recent = collections.OrderedDict()

    def step(mbs):
        hits = total = 0
        for ids in mbs:
            hits += sum(1 for i in ids.tolist() if i in recent)
            total += ids.numel()
        for ids in mbs:  # admitted at the step boundary, most recent last
            for i in ids.tolist():
                recent.pop(i, None)
                recent[i] = True
        while len(recent) > capacity:
            recent.popitem(last=False)
        return hits, total
    return step


def _static(top):
    def step(mbs):
        return sum(int(torch.isin(ids, top).sum()) for ids in mbs), sum(i.numel() for i in mbs)
    return step


def bench_cache(args, ids) -> None:
    per_step = args.global_batch // args.micro_batch
    steps = args.cache_steps
    mbs = text_microbatches(ids, per_step * steps, args.micro_batch, args.seq, seed=1)
    unique = [mb["tokens"].unique() for mb in mbs]
    by_step = [unique[i:i + per_step] for i in range(0, len(unique), per_step)]
    freq = torch.bincount(ids, minlength=args.vocab)
    print(f"cache: {steps} steps of {per_step} micro-batches of {args.micro_batch} x {args.seq} "
          f"GCIDE tokens, vocab {args.vocab}; {statistics.mean(u.numel() for u in unique):.0f} "
          f"unique ids per micro-batch; unique-row hit rate after a {steps // 5}-step warm-up")
    sizes = [int(args.vocab * f) for f in (0.01, 0.05, 0.1, 0.25)]
    print(f"{'policy':<22}" + "".join(f"{s:>9}" for s in sizes))
    policies = {"LFU aging 0.9": lambda c: _lfu(args.vocab, c, 0.9),
                "LFU aging 0.99 (ours)": lambda c: _lfu(args.vocab, c, 0.99),
                "LFU, no aging": lambda c: _lfu(args.vocab, c, 1.0),
                "LRU": _lru,
                "static top-k oracle": lambda c: _static(torch.topk(freq, c).indices)}
    for name, make in policies.items():
        rates = []
        for size in sizes:
            step = make(size)
            hits = total = 0
            for i, s in enumerate(by_step):
                h, t = step(s)
                if i >= steps // 5:
                    hits, total = hits + h, total + t
            rates.append(hits / total)
        print(f"{name:<22}" + "".join(f"{r:>9.1%}" for r in rates))

    print("training: bytes copied to the device per step through the store (misses and "
          "refreshes of updated cached rows), relative to no cache, for k micro-batches per step:")
    accumulations = (per_step, 4 * per_step)
    print(f"{'cache rows':>10}" + "".join(f"{u + ' k=' + str(k):>12}" for u in ("lazy", "dense")
                                          for k in accumulations) + f"{'token hits':>12}")
    tables = [torch.nn.Module() for _ in range(2)]
    for t in tables:
        t.weight = torch.nn.Parameter(torch.zeros(args.vocab, 64), requires_grad=False)
    base = {}
    for size in [0] + sizes:
        row = []
        for update in ("lazy", "dense"):
            for k in accumulations:
                stats = _store_bytes(tables, mbs, k, size, update, warmup=len(mbs) // 5)
                base.setdefault((update, k), stats["h2d_bytes"])
                row.append(stats["h2d_bytes"] / base[update, k])
        hits = f"{stats['cache_token_hit_rate']:.1%}" if size else "-"
        print(f"{size:>10}" + "".join(f"{r:>12.2f}" for r in row) + f"{hits:>12}")


def _store_bytes(tables, mbs, per_step, cache_rows, update, warmup) -> dict:
    store = HostTableStore(tables, torch.device("cpu"), torch.float32, cache_rows)
    for i in range(0, len(mbs) - per_step + 1, per_step):
        if i and i >= warmup and i - per_step < warmup:
            store.take_stats()
        step_mbs = mbs[i:i + per_step]
        store.stage(step_mbs)
        for mb in step_mbs:
            store.lookup(mb["tokens"], tables[0])
        rows, _, _ = store.take_row_grads()
        store.rows_changed(rows if update == "lazy" else None)
    stats = store.take_stats()
    store.close()
    return stats


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="gather,step,cache")
    ap.add_argument("--width", type=int, default=1024, help="gather: row width")
    ap.add_argument("--gather-vocab", type=int, default=65536)
    ap.add_argument("--gather-rows", type=int, default=8192)
    ap.add_argument("--gather-threads", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=8192, help="tokenizer and table rows")
    ap.add_argument("--tokenizer", default=None, help="a SentencePiece .model (else trained)")
    ap.add_argument("--model-vocab", type=int, default=0,
                    help="step: table rows when larger than the tokenizer's (default --vocab)")
    ap.add_argument("--kernel", default="deepspeed", choices=["deepspeed", "torch"])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--stem-layers", default="full")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--update", default="lazy", choices=["lazy", "dense"])
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--cache-rows", type=int, default=0, help="step: also with this cache")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--cache-steps", type=int, default=50)
    args = ap.parse_args()
    parts = args.parts.split(",")
    init_distributed(ParallelConfig())
    if "gather" in parts:
        bench_gather(args)
    ids = text_ids(args.vocab, args.tokenizer) if {"step", "cache"} & set(parts) else None
    if "step" in parts:
        bench_step(args, ids)
    if "cache" in parts:
        bench_cache(args, ids)
    destroy_distributed()


if __name__ == "__main__":
    main()
