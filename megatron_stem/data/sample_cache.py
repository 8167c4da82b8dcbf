"""A run's megatron-core GPT datasets: planned from the recipe, built ahead of time into a
shared cache, loaded by every rank without waiting and without per-document memory.

megatron's `BlendedMegatronDatasetBuilder` builds the sample indices on rank 0 while every
other rank waits in a barrier, and gives every rank an int32 `arange` of each split's
documents that it keeps for the whole run: at 3.5 billion documents, tens of minutes of
rank 0 against the process groups' timeout (`parallel.timeout_minutes`, 30), and 14 GB per rank (docs/data.md,
"Training data at scale"). Here the same datasets (megatron's `GPTDataset` and `BlendedDataset`, the same
document ranges, sample counts and configuration, hence the same cache files and the same
samples) are:

- *planned* (`Plan`): which prefixes, how many samples of each split of each, how blended;
- *built* (`build`) into `data.cache_dir`, by `tools/build_data_cache.py` (prefixes in
  parallel processes) or, when small, by rank 0 at start; each dataset's files are marked
  ready only once written, so a killed build resumes and is never read half-written;
- *loaded* (`Plan.datasets(deferred=True)`) with megatron's deferred index mmaps and a
  document range (a slice, not an array): no barrier, nothing read before a sample is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import glob
import math
import mmap
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_builder import _get_size_per_split_per_dataset
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.utils import Split, normalize

from megatron_stem.data.prefix_sets import DEFAULT_MAX_TOKENS, Prefix
from megatron_stem.runtime.errors import UserError

SPLITS = list(Split)  # train, valid, test
# Cold build cost per element on one core, fitted by bench/data_scale.py: each document of
# a split's document index (the index, its shuffle) and each sample of its sample index (
# build_sample_idx, the shuffle index, the blend's indices), writes included.
SECONDS_PER_DOCUMENT = 0.18e-6
SECONDS_PER_SAMPLE = 0.18e-6
# Bytes of the cache per element, fitted by bench/data_scale.py the same way.
CACHE_BYTES_PER_DOCUMENT = 4.0
CACHE_BYTES_PER_SAMPLE = 11.6
# A missing cache predicted to take longer than this on rank 0 (while the other ranks wait
# in a barrier, under the process groups' timeout) is refused: build it ahead of time.
BUILD_AT_START_LIMIT_S = 300.0


@dataclass
class Plan:
    """The datasets of one blend: `prefixes` (weighted, or sampled by size when `weights` is
    None), each split's range of every prefix's documents (`split_matrix`, megatron's
    bookends, None for a split not read) and each split's samples (`sizes`)."""

    name: str  # for messages: "training", "validation set <name>"
    config: GPTDatasetConfig
    prefixes: list[Prefix]
    weights: Optional[list[float]]
    split_matrix: list
    sizes: list[Optional[int]]

    def __post_init__(self):
        if self.weights is not None:
            self.weights = normalize(self.weights)
            self.target = _get_size_per_split_per_dataset(self.weights, self.sizes)
            self.per_prefix = _get_size_per_split_per_dataset(
                self.weights, self.sizes, surplus=self.config.mid_level_dataset_surplus)
        elif len(self.prefixes) == 1:
            self.per_prefix = [self.sizes]
        else:  # one epoch of each, blended by their sizes
            self.per_prefix = [[None] * len(SPLITS) for _ in self.prefixes]

    @property
    def blended(self) -> bool:
        return self.weights is not None or len(self.prefixes) > 1

    # -- the datasets

    def datasets(self, deferred: bool) -> list:
        """The top-level dataset of each split (None where not read), as megatron's builder
        makes them. `deferred`: read nothing until a sample is (the cache must be ready)."""
        config = self._config(deferred)
        mids = [self.prefix_datasets(j, deferred) for j in range(len(self.prefixes))]
        if not self.blended:
            return mids[0]
        return [self._blend(i, [m[i] for m in mids], config)
                if self.split_matrix[i] is not None else None for i in range(len(SPLITS))]

    def _config(self, deferred: bool) -> GPTDatasetConfig:
        return (dataclasses.replace(self.config, defer_npy_index_mmap=True) if deferred
                else self.config)

    def prefix_datasets(self, j: int, deferred: bool) -> list:
        """Prefix `j`'s dataset of each split (None where not read)."""
        prefix, config = self.prefixes[j].path, self._config(deferred)
        low = GPTDataset.build_low_level_dataset(prefix, config)
        if deferred:
            _read_randomly(low)
        count = GPTDataset.numel_low_level_dataset(low)
        out = []
        for i, split in enumerate(SPLITS):
            bookends = self.split_matrix[i]
            if bookends is None:
                out.append(None)
                continue
            beg, end = (int(round(b * float(count))) for b in bookends)
            # A slice reads the split's lengths in place; megatron's builder makes an
            # int32 array of the document ids (needed only to build the document index).
            indices = slice(beg, end) if deferred else np.arange(beg, end, dtype=np.int32)
            out.append(GPTDataset(low, prefix, indices, self.per_prefix[j][i], split, config))
        return out

    def _blend(self, i: int, datasets: list, config) -> BlendedDataset:
        if self.weights is not None and self.sizes[i] is not None:
            weights, size = self.weights, sum(t[i] for t in self.target)
        else:  # by size, as megatron does without weights
            weights = [len(d) for d in datasets]
            size = None if self.sizes[i] is None else min(self.sizes[i], sum(weights))
        return BlendedDataset(datasets, weights, size, config)

    # -- the cache

    def ready(self) -> bool:
        """Whether every dataset of the plan is built in the cache."""
        return all(_is_ready(d) for d in _all_datasets(self, deferred=True))

    def estimated_build_seconds(self) -> float:
        """What building the plan's indices costs on one core (`SECONDS_PER_*`), from the
        prefixes' sizes on disk: no per-document read."""
        seq = self.config.sequence_length
        documents = samples = 0.0
        for j, prefix in enumerate(self.prefixes):
            tokens = prefix.tokens
            for i, bookends in enumerate(self.split_matrix):
                if bookends is None:
                    continue
                share = bookends[1] - bookends[0]
                epoch_samples = max(1.0, tokens * share / seq)
                wanted = self.per_prefix[j][i]
                epochs = 1 if wanted is None else max(1, math.ceil(wanted / epoch_samples))
                documents += epochs * prefix.documents * share
                samples += epochs * epoch_samples
        blend_samples = sum(s or 0 for s in self.sizes) if self.blended else 0
        return SECONDS_PER_DOCUMENT * documents + SECONDS_PER_SAMPLE * (samples + blend_samples)


@dataclass(frozen=True)
class SourceShare:
    """One data source's part of a stage's sample indices: as many prefixes of
    `documents` documents each, every one of whose index holds `samples` samples (epochs
    included: a source read more than once is indexed that many times)."""

    prefixes: int
    documents: float
    samples: float


def source_shares(sources, seq_length: int, samples: int) -> list[SourceShare]:
    """The shares of `sources` (a data recipe's, each with its `tokens`, `documents` and
    `weight`) in a stage of `samples` sequences of `seq_length`."""
    weights = sum(s.weight for s in sources)
    shares = []
    for s in sources:
        prefixes = max(1, math.ceil(s.tokens / DEFAULT_MAX_TOKENS))  # preprocessing's cut
        epoch = s.tokens / seq_length
        epochs = max(1, math.ceil(samples * s.weight / weights / epoch))
        shares.append(SourceShare(prefixes, epochs * s.documents / prefixes,
                                  epochs * epoch / prefixes))
    return shares


def predicted_bytes(shares: list[SourceShare], samples: int) -> float:
    """The cache of a stage of `samples` samples read from `shares`: every prefix's
    indices, then the blend's."""
    return sum(s.prefixes * (CACHE_BYTES_PER_DOCUMENT * s.documents +
                             CACHE_BYTES_PER_SAMPLE * s.samples) for s in shares) + \
        CACHE_BYTES_PER_SAMPLE * samples


def _read_randomly(low) -> None:
    """A sample reads a few pages at a random place of the `.bin` (and of the `.idx`): the
    kernel's read-ahead would turn each page fault of a cold cache into hundreds of KB of
    reads (bench/data_scale.py measures a step's batch both ways)."""
    for memmap in (getattr(low.bin_reader, "_bin_buffer_mmap", None),  # megatron-core 0.16
                   getattr(low.index, "bin_buffer_mmap", None)):
        raw = getattr(memmap, "_mmap", None)
        if raw is not None:
            raw.madvise(mmap.MADV_RANDOM)


def dataset_config(seed: int, seq_length: int, tokenizer, cache_dir: str, data,
                   **blend) -> GPTDatasetConfig:
    """megatron's dataset config: `blend` and `split`, or `blend_per_split`; `data` the
    recipe's DataConfig (document masking)."""
    return GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, path_to_cache=cache_dir,
        tokenizer=tokenizer, reset_position_ids=data.reset_position_ids,
        reset_attention_mask=data.reset_attention_mask, eod_mask_loss=data.eod_mask_loss,
        create_attention_mask=False,  # a dense [s, s] mask; documents go to attention instead
        **blend)


# -- cache files ---------------------------------------------------------------------------


def _base(dataset) -> str:
    """megatron's cache path stem of a dataset: <hash>-<class>-<split>."""
    split = dataset.index_split if isinstance(dataset, GPTDataset) else dataset.split
    return os.path.join(dataset.config.path_to_cache,
                        f"{dataset.unique_description_hash}-{type(dataset).__name__}-"
                        f"{split.name}")


def cache_bytes(folder: str) -> int:
    """Bytes of the sample indices (megatron's `.npy` files) in a cache folder."""
    return sum(e.stat().st_size for e in os.scandir(folder)
               if e.is_file() and e.name.endswith(".npy"))


def _is_ready(dataset) -> bool:
    return os.path.isfile(_base(dataset) + "-ready")


def _mark_ready(dataset) -> None:
    path = _base(dataset) + "-ready"
    with open(path, "w") as f:
        f.flush()
        os.fsync(f.fileno())


def _clear(dataset) -> None:
    """A dataset's files from a build that did not finish: megatron would load them."""
    for path in glob.glob(glob.escape(_base(dataset)) + "-*"):
        os.remove(path)


def _all_datasets(plan: Plan, deferred: bool):
    top = plan.datasets(deferred)
    if not plan.blended:
        return [d for d in top if d is not None]
    return [d for b in top if b is not None for d in (*b.datasets, b)]


# -- building ------------------------------------------------------------------------------


_BUILDING: list[Plan] = []  # the plans a build's forked workers read (set before forking)


def _build_prefix(plan_index: int, j: int) -> float:
    """Build one prefix's split datasets of plan `plan_index` (in a worker); seconds."""
    start = time.perf_counter()
    plan = _BUILDING[plan_index]
    pending = [d for d in plan.prefix_datasets(j, deferred=True)
               if d is not None and not _is_ready(d)]
    for d in pending:
        _clear(d)
    for d in plan.prefix_datasets(j, deferred=False):
        if d is not None and not _is_ready(d):
            _mark_ready(d)
    return time.perf_counter() - start


def build(plans: list[Plan], workers: int = 1,
          progress: Callable[[str], None] = lambda line: None) -> None:
    """Build every dataset the plans need that the cache does not hold: each plan's
    prefixes (in `workers` forked processes when more than one), then its blend."""
    for plan in plans:
        os.makedirs(plan.config.path_to_cache, exist_ok=True)
    with _build_lock(plans[0].config.path_to_cache, progress):
        plans = [p for p in plans if not p.ready()]  # another run may have built them
        if plans:
            _build(plans, workers, progress)


@contextlib.contextmanager
def _build_lock(cache: str, progress):
    """One build at a time in a cache: two runs of the same data starting together (the
    dense and STEM runs of a stage) build it once, the second then finds it ready."""
    with open(os.path.join(cache, ".build.lock"), "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"waiting for another process building in {cache}")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build(plans: list[Plan], workers: int, progress) -> None:
    _BUILDING[:] = plans
    tasks = []
    for p, plan in enumerate(plans):
        for j in range(len(plan.prefixes)):
            mids = plan.prefix_datasets(j, deferred=True)
            if not all(_is_ready(d) for d in mids if d is not None):
                tasks.append((p, j))
    progress(f"{len(tasks)} prefix(es) to index, {workers} worker(s)")
    done = 0
    if workers > 1 and len(tasks) > 1:
        import multiprocessing
        with ProcessPoolExecutor(workers, multiprocessing.get_context("fork")) as pool:
            futures = [pool.submit(_build_prefix, p, j) for p, j in tasks]
            for (p, j), future in zip(tasks, futures):
                done += 1
                progress(f"[{done}/{len(tasks)}] {plans[p].prefixes[j].path}: "
                         f"{future.result():.1f} s")
    else:
        for p, j in tasks:
            done += 1
            progress(f"[{done}/{len(tasks)}] {plans[p].prefixes[j].path}: "
                     f"{_build_prefix(p, j):.1f} s")
    for plan in plans:
        if plan.blended:
            _build_blends(plan, progress)
    _BUILDING.clear()


def _build_blends(plan: Plan, progress) -> None:
    pending = [b for b in plan.datasets(deferred=True) if b is not None and not _is_ready(b)]
    if not pending:
        return
    start = time.perf_counter()
    for b in pending:
        _clear(b)
    with _single_process_group():  # megatron's BlendedDataset asks for the rank when building
        for b in plan.datasets(deferred=False):
            if b is not None and not _is_ready(b):
                _mark_ready(b)
    progress(f"{plan.name} blend of {len(plan.prefixes)} prefixes: "
             f"{time.perf_counter() - start:.1f} s")


class _single_process_group:
    """A one-process gloo group where none exists (the offline tool); else nothing."""

    def __enter__(self):
        self.made = not torch.distributed.is_initialized()
        if self.made:
            torch.distributed.init_process_group(
                "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)

    def __exit__(self, *exc):
        if self.made:
            torch.distributed.destroy_process_group()


# -- at the start of a run -------------------------------------------------------------------


def prepare(plans: list[Plan], rank: int, barrier: Callable[[], None],
            build_command: str) -> None:
    """Make sure the plans' cache is ready on every rank. Missing and small: rank 0 builds
    it while the others wait. Missing and large (past `BUILD_AT_START_LIMIT_S`): refused on
    every rank alike, naming the command that builds it ahead of time."""
    missing = [p for p in plans if not p.ready()]
    if missing:
        _refuse_if_long(missing, build_command)
        if rank == 0:
            build(missing)
    # Always: a rank that found the cache ready (built by rank 0 a moment ago) must not run
    # ahead of one that waits for it.
    barrier()


def _refuse_if_long(missing: list[Plan], build_command: str) -> None:
    seconds = sum(p.estimated_build_seconds() for p in missing)
    if seconds > BUILD_AT_START_LIMIT_S:
        documents = sum(pr.documents for p in missing for pr in p.prefixes)
        raise UserError(
            f"data.cache_dir: the sample indices of this run's data ({documents:,} documents "
            f"in {sum(len(p.prefixes) for p in missing)} prefixes) are not in "
            f"{missing[0].config.path_to_cache}; building them here would keep rank 0 busy "
            f"~{seconds / 60:.0f} min while the other ranks wait: build them first with "
            f"{build_command}")
