"""Checkpoint storage on this machine: save and load rates, checksum rates, and the node
time of a 1B save they predict.

    python bench/checkpoint_storage.py [--size-mb 1024] [--dir DIR] [--dp 32]
                                       [--ranks-per-node 8] [--verify-gb 2.9]

Measures one process writing and reading a megatron dist checkpoint (torch_dist, the
training's save strategy, fsync included; the page cache is dropped for the files before
the load, so it reads from storage), and how long a save keeps the training thread:
synchronous against `train.async_save` (checkpoint/background.py: blocked only while the
state is copied to host memory). Then predicts the 1B save (recipes/stem_1b.yaml, bf16
weights + fp32 master and two Adam moments for every parameter) per rank and per node at
data parallel `--dp`, for three layouts of who writes what:

* rank 0 writes all            megatron's default strategy;
* parallel, replicated tables  `tables.partition: replicated`: each DP-replicated tensor
                               (the weights, the tables' states) is written by one rank,
                               whole tensors balanced over DP (megatron's greedy
                               distribution); each rank writes its ZeRO partition of the
                               dense states (1/DP, checkpoint/zero_state.py);
* parallel, sharded tables     `tables.partition: sharded` (the default): as above, but
                               each rank writes the table state rows it owns (1/DP).

Then compares checksum algorithms on one core over 256 MB in memory (crc32c only where
the `crc32c` package is installed): a save hashes its bytes at that rate as it writes
them. And it times ours (megatron_stem/checkpoint/checksums.py) over one rank's share of a
1B checkpoint (`--verify-gb`, 2.9 GB at DP32: a synthetic file) from storage (page cache
dropped), as a resume or tools/verify_checkpoint.py reads it.

A node's ranks write at once: the node time assumes they share this process's rate (a
parallel filesystem usually gives a node more; scale by your storage's per-node rate).
SLURM's stop warning in slurm/*.sbatch is 300 s (`--signal=B:USR1@300`).
"""

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor

from megatron_stem.checkpoint.background import BackgroundSave
from megatron_stem.checkpoint import parallel_save_strategy
from megatron_stem.checkpoint.checksums import digest
from megatron_stem.config import ParallelConfig, load_recipe
from megatron_stem.runtime.parallel import destroy_distributed, init_distributed

ROOT = Path(__file__).resolve().parent.parent
WARNING_S = 300


def _state(size_mb: int, parts: int = 8, fill: bool = True) -> dict:
    numel = size_mb * 2**20 // 4 // parts
    return {f"t{i}": ShardedTensor.from_rank_offsets(
        f"t{i}", torch.randn(numel) if fill else torch.empty(numel), replica_id=0)
        for i in range(parts)}


def _drop_page_cache(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def measure(size_mb: int, folder: Path) -> tuple[float, float]:
    """(save GB/s, load GB/s) of one process."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    state = _state(size_mb)
    start = time.perf_counter()
    dist_checkpointing.save(state, str(folder), sharded_strategy=parallel_save_strategy())
    save_s = time.perf_counter() - start
    _drop_page_cache(folder)
    start = time.perf_counter()
    loaded = dist_checkpointing.load(_state(size_mb, fill=False), str(folder))
    load_s = time.perf_counter() - start
    assert all(torch.equal(loaded[k], state[k].data) for k in state)
    shutil.rmtree(folder)
    gb = size_mb * 2**20 / 1e9
    return gb / save_s, gb / load_s


def blocking(size_mb: int, folder: Path) -> tuple[float, float, float]:
    """Seconds a save of `size_mb` keeps the training thread: (synchronous save,
    background save's blocked part, background save until whole and fsynced)."""
    shutil.rmtree(folder, ignore_errors=True)
    state = _state(size_mb)
    sync_dir, async_dir = folder / "sync", folder / "async"
    for d in (sync_dir, async_dir):
        d.mkdir(parents=True)
    start = time.perf_counter()
    dist_checkpointing.save(state, str(sync_dir), sharded_strategy=parallel_save_strategy())
    sync_s = time.perf_counter() - start
    start = time.perf_counter()
    background = BackgroundSave()
    background.add(state, async_dir)
    background.start()
    blocked_s = time.perf_counter() - start
    background.finish(async_dir)
    whole_s = time.perf_counter() - start
    loaded = dist_checkpointing.load(_state(size_mb, fill=False), str(async_dir))
    assert all(torch.equal(loaded[k], state[k].data) for k in state)
    shutil.rmtree(folder)
    return sync_s, blocked_s, whole_s


def compare_checksums(megabytes: int = 256) -> dict[str, float]:
    """{algorithm: GB/s} over `megabytes` of random bytes in memory, one core."""
    import hashlib
    import zlib

    import xxhash

    algorithms = {"xxh3_64": lambda b: xxhash.xxh3_64(b).digest(),
                  "xxh64": lambda b: xxhash.xxh64(b).digest(),
                  "zlib.crc32": zlib.crc32, "sha1": lambda b: hashlib.sha1(b).digest(),
                  # megatron-core 0.18+'s `save(verify_integrity=True)` manifest
                  "sha256": lambda b: hashlib.sha256(b).digest()}
    try:
        import crc32c
        algorithms["crc32c"] = crc32c.crc32c
    except ImportError:
        pass
    data = memoryview(os.urandom(megabytes << 20))
    rates = {}
    for name, fn in algorithms.items():
        start = time.perf_counter()
        fn(data)
        rates[name] = len(data) / 1e9 / (time.perf_counter() - start)
    return rates


def measure_checksum(gb: float, folder: Path) -> tuple[float, float]:
    """(write s, checksum s from storage) of a `gb` file."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "share.bin"
    block = os.urandom(64 << 20)
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(int(gb * 1e9) // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - start
    _drop_page_cache(folder)
    start = time.perf_counter()
    digest(path)
    cold_s = time.perf_counter() - start
    path.unlink()
    return write_s, cold_s


def tensors_1b(recipe) -> tuple[list[int], list[int], list[int]]:
    """Bytes of every saved tensor of the 1B model: (dense weights and states, table
    weights, table states). Each parameter has its weight (training dtype) and three fp32
    optimizer states."""
    m = recipe.model
    d, ff, vocab, head = m.hidden_size, m.ffn_hidden_size, m.vocab_size, \
        m.hidden_size // m.num_attention_heads
    stem = set(m.stem_layer_indices)
    dense = [vocab * d] * (2 if m.untie_embeddings else 1)
    for layer in range(m.num_layers):
        dense += [d * head * (m.num_attention_heads + 2 * m.kv_heads), d * d,
                  ff * d * (1 if layer in stem else 2), ff * d]
    tables = [vocab * ff] * len(stem)
    weight = 2 if recipe.train.dtype == "bf16" else 4
    table_weight = 4 if recipe.tables.placement == "host" else weight
    return ([n * b for n in dense for b in (weight, 4, 4, 4)],
            [n * table_weight for n in tables], [n * 4 for n in tables for _ in range(3)])


def rank_loads(sizes: list[int], ranks: int) -> list[int]:
    """Bytes per rank when whole tensors go, largest first, to the least loaded rank
    (megatron's `distribute_shards_to_ranks`)."""
    load = [0] * ranks
    for size in sorted(sizes, reverse=True):
        load[load.index(min(load))] += size
    return load


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=1024, help="checkpoint size to time")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp folder "
                    "in the current directory: put it on the storage checkpoints go to)")
    ap.add_argument("--dp", type=int, default=32, help="data-parallel ranks (1B: 4 x 8)")
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--verify-gb", type=float, default=2.9,
                    help="one rank's share of the checksums to time (0: skip)")
    args = ap.parse_args()
    init_distributed(ParallelConfig(), seed=0)
    folder = Path(args.dir or tempfile.mkdtemp(prefix="bench_checkpoint_storage_", dir="."))
    try:
        save_rate, load_rate = measure(args.size_mb, folder / "ckpt")
        sync_s, blocked_s, whole_s = blocking(args.size_mb, folder / "blocking")
        checksum = measure_checksum(args.verify_gb, folder) if args.verify_gb else None
    finally:
        destroy_distributed()
        if not args.dir:
            shutil.rmtree(folder, ignore_errors=True)
    print(f"{args.size_mb} MB, one process: save {save_rate:.2f} GB/s, load {load_rate:.2f} "
          "GB/s (shared machine: noisy)")
    print(f"the step waits: synchronous save {sync_s:.2f} s; train.async_save {blocked_s:.2f} "
          f"s ({blocked_s / sync_s:.3f} of it; whole and fsynced after {whole_s:.2f} s, "
          "in the background)")
    rates = compare_checksums()
    print("checksums, one core, in memory: " + ", ".join(
        f"{name} {rate:.1f} GB/s" for name, rate in sorted(rates.items(), key=lambda x: -x[1])))
    if checksum is not None:
        write_s, cold_s = checksum
        gb = args.verify_gb
        print(f"checksums of {gb:.1f} GB (one rank's share) from storage: {cold_s:.1f} s "
              f"({gb / cold_s:.2f} GB/s; writing it took {write_s:.1f} s)")
    dense, table_weights, table_states = tensors_1b(
        load_recipe(ROOT / "recipes" / "stem_1b.yaml"))
    tables = table_weights + table_states
    total = sum(dense) + sum(tables)
    dp, node = args.dp, min(args.ranks_per_node, args.dp)
    print(f"1B checkpoint: {total / 1e9:.1f} GB (dense {sum(dense) / 1e9:.1f}, tables "
          f"{sum(tables) / 1e9:.1f}); DP {dp}, {node} ranks per node; at {save_rate:.2f} GB/s:")
    print(f"{'layout':<30}{'GB/rank':>9}{'s/rank':>9}{'GB/node':>9}{'s/node':>9}  fits 300 s?")
    dense_weights, dense_states = dense[0::4], sum(dense) - sum(dense[0::4])
    layouts = {"rank 0 writes all": [total] + [0] * (dp - 1),
               "parallel, replicated tables": [
                   load + dense_states // dp
                   for load in rank_loads(dense_weights + table_weights + table_states, dp)],
               "parallel, sharded tables": [
                   load + (dense_states + sum(table_states)) // dp
                   for load in rank_loads(dense_weights + table_weights, dp)]}
    for name, loads in layouts.items():
        per_rank = max(loads)
        per_node = max(sum(loads[i:i + node]) for i in range(0, dp, node))
        seconds = per_node / 1e9 / save_rate
        verdict = "yes, 2x margin" if seconds * 2 <= WARNING_S else \
            "yes, under 2x margin" if seconds <= WARNING_S else "NO"
        print(f"{name:<30}{per_rank / 1e9:>9.1f}{per_rank / 1e9 / save_rate:>9.0f}"
              f"{per_node / 1e9:>9.1f}{seconds:>9.0f}  {verdict}")

if __name__ == "__main__":
    main()
