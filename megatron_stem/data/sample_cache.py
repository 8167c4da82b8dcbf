"""A run's megatron-core GPT datasets: planned from the recipe, built ahead of time into a
shared cache, loaded by every rank without waiting and without per-document work.

megatron's `BlendedMegatronDatasetBuilder` builds the sample indices on rank 0 while every
other rank waits in a barrier; it gives every rank an int32 `arange` of each split's
documents for the whole run, and its deferred datasets count their samples by summing every
document's length: at 3.5 billion documents, tens of minutes of rank 0 against the process groups'
timeout (`parallel.timeout_minutes`, 30), and 14 GB per rank (docs/data.md, "Training data at scale"). Here the
same datasets (megatron's `GPTDataset` and `BlendedDataset`, the same document ranges,
sample counts and configuration, hence the same cache files and the same samples) are:

- *planned* (`Plan`): which prefixes, how many samples of each split of each, how blended;
  a split's tokens are the difference of two `.idx` pointers, its samples follow;
- *built* (`build`) into `data.cache_dir`, only what is missing: by
  `tools/build_data_cache.py` (prefixes in parallel processes, a blend in parallel
  threads: data/blend.py) or, when quick, by rank 0 at start. Each dataset's files are
  written in a private folder, renamed into the cache, then marked ready: no reader sees a
  file half written, and two builders no lock keeps apart (on two nodes of a filesystem
  whose locks are per node) each put the same files in place whole;
- *loaded* (`Plan.datasets`): megatron's deferred datasets, given their sample counts, their
  index files mapped at first use with the kernel's read-ahead off: no barrier, nothing
  read before a sample is, then only the pages a sample needs.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
import shutil
import socket
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_builder import _get_size_per_split_per_dataset
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.utils import Split, normalize

from megatron_stem.data import blend
from megatron_stem.data.indexed import IndexHeader, idx_path, read_header, tokens_between
from megatron_stem.data.prefix_sets import DEFAULT_MAX_TOKENS, Prefix
from megatron_stem.runtime import file_locks
from megatron_stem.runtime.durable import fsync_path
from megatron_stem.runtime.errors import UserError

SPLITS = list(Split)  # train, valid, test
# Cold build cost on one core, fitted by bench/data_scale.py: each document of a prefix
# split's document index (the index, its shuffle) and each sample of its sample and
# shuffle indices, writes included; each sample of a blend (data/blend.py).
SECONDS_PER_DOCUMENT = 0.18e-6
SECONDS_PER_SAMPLE = 0.18e-6
SECONDS_PER_BLEND_SAMPLE = 0.1e-6
# Bytes of the cache per element, fitted by bench/data_scale.py the same way.
CACHE_BYTES_PER_DOCUMENT = 4.0
CACHE_BYTES_PER_SAMPLE = 11.6
# Missing indices predicted to take longer than this on rank 0 (while the other ranks wait)
# are refused: build them ahead of time.
BUILD_AT_START_LIMIT_S = 300.0
LOCK = ".build.lock"
NO_LOCKS_REMEDY = ("put data.cache_dir on a filesystem with file locks (Lustre: mounted "
                   "with flock)")


@dataclass(frozen=True)
class Missing:
    """Indices the cache lacks: prefix `prefix`'s dataset of split `split`, or (prefix
    None) the split's blend."""

    split: int
    prefix: Optional[int] = None


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
        self._deferred = dataclasses.replace(self.config, defer_npy_index_mmap=True)
        self._headers: dict[int, IndexHeader] = {}
        self._indexed: dict[int, IndexedDataset] = {}
        self._tokens: dict[tuple[int, int], int] = {}
        self._made: dict[tuple[int, int], GPTDataset] = {}  # deferred, by (prefix, split)
        self._top: Optional[list] = None

    @property
    def blended(self) -> bool:
        return self.weights is not None or len(self.prefixes) > 1

    @property
    def read_splits(self) -> list[int]:
        return [i for i, bookends in enumerate(self.split_matrix) if bookends is not None]

    # -- the datasets

    def datasets(self) -> list:
        """The top-level dataset of each split (None where not read), as megatron's builder
        makes them, deferred: nothing is read until a sample is (the cache must be ready).
        Made once per plan."""
        if self._top is None:
            prefix_sets = [self.prefix_datasets(j) for j in range(len(self.prefixes))]
            self._top = prefix_sets[0] if not self.blended else [
                self._blend(i, [d[i] for d in prefix_sets]) if i in self.read_splits else None
                for i in range(len(SPLITS))]
        return self._top

    def prefix_datasets(self, j: int) -> list:
        """Prefix `j`'s deferred dataset of each split (None where not read)."""
        return [self._dataset(j, i) if i in self.read_splits else None
                for i in range(len(SPLITS))]

    def _dataset(self, j: int, i: int, building_in: Optional[str] = None) -> GPTDataset:
        """Prefix j's dataset of split i: deferred (made once per plan), or (`building_in`:
        a folder) built there by megatron from an array of the split's document ids."""
        begin, end = self._documents(j, i)
        if building_in is not None:
            config = dataclasses.replace(self.config, path_to_cache=building_in)
            return GPTDataset(self._indexed_dataset(j), self.prefixes[j].path,
                              np.arange(begin, end, dtype=np.int32), self.per_prefix[j][i],
                              SPLITS[i], config)
        if (j, i) not in self._made:
            dataset = GPTDataset(self._indexed_dataset(j), self.prefixes[j].path,
                                 slice(begin, end),  # read in place, not an int32 array
                                 self.per_prefix[j][i], SPLITS[i], self._deferred)
            _given_tokens(dataset, self.tokens(j, i))
            _map_indices_at_first_read(dataset, _GPT_INDICES)
            self._made[j, i] = dataset
        return self._made[j, i]

    def _blend(self, i: int, members: list) -> BlendedDataset:
        if self.weights is not None and self.sizes[i] is not None:
            weights, size = self.weights, sum(t[i] for t in self.target)
        else:  # by size, as megatron does without weights
            weights = [len(d) for d in members]
            size = None if self.sizes[i] is None else min(self.sizes[i], sum(weights))
        dataset = BlendedDataset(members, weights, size, self._deferred)
        _map_indices_at_first_read(dataset, _BLEND_INDICES)
        return dataset

    def _indexed_dataset(self, j: int) -> IndexedDataset:
        """Prefix j's `.bin/.idx`, opened once per plan from its header alone (megatron's
        fast cache load: nothing else read), mapped for random reads."""
        if j not in self._indexed:
            path, header = self.prefixes[j].path, self._header(j)
            indexed = IndexedDataset(path, mmap=self.config.mmap_bin_files,
                                     fast_cache_load=True,
                                     sequences_per_dataset=(header.sequences, header.documents),
                                     dtype_code=header.dtype_code)
            _read_randomly(indexed)
            self._indexed[j] = indexed
        return self._indexed[j]

    def _header(self, j: int) -> IndexHeader:
        if j not in self._headers:
            self._headers[j] = read_header(idx_path(self.prefixes[j].path))
        return self._headers[j]

    def _documents(self, j: int, i: int) -> tuple[int, int]:
        """Prefix j's documents of split i, [begin, end), as megatron's bookends cut them."""
        count = GPTDataset.numel_low_level_dataset(self._indexed_dataset(j))
        begin, end = (int(round(b * float(count))) for b in self.split_matrix[i])
        return begin, end

    def tokens(self, j: int, i: int) -> int:
        """The tokens of prefix j's documents of split i: two `.idx` pointers, not a sum."""
        if (j, i) not in self._tokens:
            self._tokens[j, i] = tokens_between(self.prefixes[j].path, self._header(j),
                                                *self._documents(j, i))
        return self._tokens[j, i]

    # -- the cache

    def missing(self) -> list[Missing]:
        """The plan's indices the cache does not hold (marked ready)."""
        out = [Missing(i, j) for j in range(len(self.prefixes))
               for i, d in enumerate(self.prefix_datasets(j)) if d is not None and not _is_ready(d)]
        if self.blended:
            out += [Missing(i) for i, b in enumerate(self.datasets())
                    if b is not None and not _is_ready(b)]
        return out

    def ready(self) -> bool:
        return not self.missing()

    def build_seconds(self, missing: list[Missing]) -> float:
        """What building `missing` costs on one core (`SECONDS_PER_*`): from the prefixes'
        headers and pointers, no per-document read."""
        seconds = 0.0
        for m in missing:
            if m.prefix is None:
                b = self.datasets()[m.split]
                seconds += SECONDS_PER_BLEND_SAMPLE * len(b)
                continue
            d = self._dataset(m.prefix, m.split)
            begin, end = self._documents(m.prefix, m.split)
            epochs = 1  # megatron's: as many as the samples need
            if d.num_samples is not None:
                wanted = d.num_samples * d.config.sequence_length + 1
                epochs = max(1, math.ceil(wanted / max(1, self.tokens(m.prefix, m.split))))
            seconds += (SECONDS_PER_DOCUMENT * epochs * (end - begin)
                        + SECONDS_PER_SAMPLE * len(d))
        return seconds


@dataclass(frozen=True)
class SourceShare:
    """One data source's part of a stage's sample indices: as many prefixes of
    `documents` documents each, every one of whose index holds `samples` samples (epochs
    included: a source read more than once is indexed that many times)."""

    prefixes: int
    documents: float
    samples: float


def prefix_tokens(tokens: float, array_tasks: int = 1) -> list[float]:
    """The prefixes' tokens of a source of `tokens` tokenized by an array of `array_tasks`
    tasks: each task cuts its share at preprocessing's `--prefix-max-tokens` default."""
    share = tokens / array_tasks
    full, last = divmod(share, DEFAULT_MAX_TOKENS)
    return ([DEFAULT_MAX_TOKENS] * int(full) + ([last] if last else [])) * array_tasks


def source_shares(sources, seq_length: int, samples: int,
                  array_tasks: int = 1) -> list[SourceShare]:
    """The shares of `sources` (a data recipe's, each with its `tokens`, `documents` and
    `weight`) in a stage of `samples` sequences of `seq_length`, each source tokenized by
    an array of `array_tasks` tasks (`prefix_tokens`): one share per prefix size."""
    weights = sum(s.weight for s in sources)
    shares = []
    for s in sources:
        epochs = max(1, math.ceil(samples * s.weight / weights / (s.tokens / seq_length)))
        sizes = prefix_tokens(s.tokens, array_tasks)
        for tokens in sorted(set(sizes), reverse=True):
            shares.append(SourceShare(sizes.count(tokens), epochs * s.documents * tokens / s.tokens,
                                      epochs * tokens / seq_length))
    return shares


def predicted_bytes(shares: list[SourceShare], samples: int) -> float:
    """The cache of a stage of `samples` samples read from `shares`: every prefix's
    indices, then the blend's."""
    return sum(s.prefixes * (CACHE_BYTES_PER_DOCUMENT * s.documents +
                             CACHE_BYTES_PER_SAMPLE * s.samples) for s in shares) + \
        CACHE_BYTES_PER_SAMPLE * samples


def _given_tokens(dataset: GPTDataset, tokens: int) -> None:
    """megatron's deferred `GPTDataset` counts its samples (`len`) from its split's tokens,
    which it sums over every document's length at each call (3.5B documents: 14 GB read
    by every rank). The sum is given instead (`Plan.tokens`); building the dataset's
    indices checks it against the lengths' (`_build_prefix`)."""
    dataset._get_num_tokens_per_epoch = lambda: tokens


def _read_randomly(indexed: IndexedDataset) -> None:
    """A sample reads a few pages at a random place of the `.bin` (and of the `.idx`): the
    kernel's read-ahead would turn each page fault of a cold cache into hundreds of KB of
    reads (bench/data_scale.py measures a step's batch both ways)."""
    for memmap in (getattr(indexed.bin_reader, "_bin_buffer_mmap", None),  # megatron-core 0.16
                   getattr(indexed.index, "bin_buffer_mmap", None)):
        raw = getattr(memmap, "_mmap", None)
        if raw is not None:
            raw.madvise(mmap.MADV_RANDOM)


_GPT_INDICES = ("document_index", "sample_index", "shuffle_index")
_BLEND_INDICES = ("dataset_index", "dataset_sample_index")


class _MappedIndex:
    """A cache `.npy` index for megatron's deferred dataset to read in place of the array
    it would load: mapped at its first read, read-ahead off (a sample reads an entry or two
    at random places of each; with read-ahead a cold 16-sample batch read 215 MB)."""

    def __init__(self, path: str):
        self.path, self.array = path, None

    def __getitem__(self, key):
        if self.array is None:
            self.array = _map_randomly(self.path)
        return self.array[key]


def _map_indices_at_first_read(dataset, names: tuple[str, ...]) -> None:
    for name in names:  # megatron loads them at the first sample when they are None
        setattr(dataset, name, _MappedIndex(getattr(dataset, f"path_to_{name}")))


def _map_randomly(path: str) -> np.ndarray:
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        version = np.lib.format.read_magic(f)
        read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                else np.lib.format.read_array_header_2_0)
        shape, fortran, dtype = read(f)
        offset = f.tell()
        if math.prod(shape) == 0:
            return np.zeros(shape, dtype)
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    mapped.madvise(mmap.MADV_RANDOM)
    return np.ndarray(shape, dtype, buffer=mapped, offset=offset, order="F" if fortran else "C")


def dataset_config(seed: int, seq_length: int, tokenizer, cache_dir: str, data,
                   **blend_args) -> GPTDatasetConfig:
    """megatron's dataset config: `blend` and `split`, or `blend_per_split`; `data` the
    recipe's DataConfig (document masking)."""
    return GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, path_to_cache=cache_dir,
        tokenizer=tokenizer, reset_position_ids=data.reset_position_ids,
        reset_attention_mask=data.reset_attention_mask, eod_mask_loss=data.eod_mask_loss,
        create_attention_mask=False,  # a dense [s, s] mask; documents go to attention instead
        **blend_args)


# -- cache files ---------------------------------------------------------------------------


def _stem(dataset) -> str:
    """megatron's cache file stem of a dataset: <hash>-<class>-<split>."""
    split = dataset.index_split if isinstance(dataset, GPTDataset) else dataset.split
    return f"{dataset.unique_description_hash}-{type(dataset).__name__}-{split.name}"


def _is_ready(dataset) -> bool:
    return os.path.isfile(os.path.join(dataset.config.path_to_cache, _stem(dataset) + "-ready"))


def cache_bytes(folder: str) -> int:
    """Bytes of the sample indices (megatron's `.npy` files) in a cache folder."""
    return sum(e.stat().st_size for e in os.scandir(folder)
               if e.is_file() and e.name.endswith(".npy"))


class _Workspace:
    """A builder's private folder in the cache (`.building-<host>-<pid>`): a dataset's
    files are written there whole, then renamed into the cache (`publish`)."""

    def __init__(self, cache: str):
        self.cache = cache
        self.path = os.path.join(cache, f".building-{socket.gethostname()}-{os.getpid()}")

    def __enter__(self) -> "_Workspace":
        shutil.rmtree(self.path, ignore_errors=True)
        os.makedirs(self.path)
        return self

    def __exit__(self, *exc):
        shutil.rmtree(self.path, ignore_errors=True)

    def publish(self, stem: str) -> None:
        """Move the files of `stem` into the cache, durable, then mark them ready."""
        names = [n for n in os.listdir(self.path) if n.startswith(stem + "-")]
        for name in names:
            fsync_path(os.path.join(self.path, name))
        for name in names:
            os.replace(os.path.join(self.path, name), os.path.join(self.cache, name))
        fsync_path(self.cache)
        fd = os.open(os.path.join(self.cache, stem + "-ready"), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_path(self.cache)


def _remove_abandoned_workspaces(cache: str) -> None:
    """Private folders of this host's builders that died (another host's cannot be told
    from a live one's: they stay, and are never read)."""
    mine = f".building-{socket.gethostname()}-"
    for name in os.listdir(cache):
        pid = name[len(mine):]
        if name.startswith(mine) and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(cache, name), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


# -- building ------------------------------------------------------------------------------


_BUILDING: list[Plan] = []  # the plans a build's forked workers read (set before forking)


def _build_prefix(plan_index: int, j: int, splits: list[int]) -> float:
    """Build splits `splits` of prefix j of plan `plan_index` (in a worker); seconds."""
    start = time.perf_counter()
    plan = _BUILDING[plan_index]
    with _Workspace(plan.config.path_to_cache) as workspace:
        for i in splits:
            built = plan._dataset(j, i, building_in=workspace.path)
            expected = len(plan._dataset(j, i))
            if len(built) != expected:
                raise UserError(
                    f"{idx_path(plan.prefixes[j].path)}: its byte pointers do not follow its "
                    f"lengths ({len(built):,} samples from the lengths, {expected:,} from the "
                    "pointers): not written by megatron's builder; write it again with "
                    "tools/preprocess_data.py")
            workspace.publish(_stem(built))
    return time.perf_counter() - start


def build(plans: list[Plan], workers: int = 1,
          progress: Callable[[str], None] = lambda line: None) -> None:
    """Build every index the plans need that the cache does not hold: each prefix's (in
    `workers` forked processes when more than one), then each blend's (in `workers`
    threads)."""
    cache = plans[0].config.path_to_cache
    os.makedirs(cache, exist_ok=True)
    with file_locks.held(os.path.join(cache, LOCK), "the data cache's build lock",
                         NO_LOCKS_REMEDY,
                         waiting=lambda: progress(f"waiting for another process building "
                                                  f"in {cache}")):
        _remove_abandoned_workspaces(cache)
        work = missing_of(plans)  # another run may have built them
        if work:
            _build(work, workers, progress)


def missing_of(plans: list[Plan]) -> list[tuple[Plan, list[Missing]]]:
    """The plans that miss indices in the cache, each with what it misses."""
    work = [(plan, plan.missing()) for plan in plans]
    return [(plan, missing) for plan, missing in work if missing]


def _build(work: list[tuple[Plan, list[Missing]]], workers: int, progress) -> None:
    _BUILDING[:] = [plan for plan, _ in work]
    tasks: dict[tuple[int, int], list[int]] = {}
    for p, (plan, missing) in enumerate(work):
        for m in missing:
            if m.prefix is not None:
                tasks.setdefault((p, m.prefix), []).append(m.split)
    progress(f"{len(tasks)} prefix(es) to index, {workers} worker(s)")
    done = 0

    def report(p: int, j: int, seconds: float) -> None:
        nonlocal done
        done += 1
        progress(f"[{done}/{len(tasks)}] {work[p][0].prefixes[j].path}: {seconds:.1f} s")

    if workers > 1 and len(tasks) > 1:
        import multiprocessing
        with ProcessPoolExecutor(workers, multiprocessing.get_context("fork")) as pool:
            futures = {key: pool.submit(_build_prefix, *key, splits)
                       for key, splits in tasks.items()}
            for key, future in futures.items():
                report(*key, future.result())
    else:
        for key, splits in tasks.items():
            report(*key, _build_prefix(*key, splits))
    for plan, missing in work:
        for m in missing:
            if m.prefix is None:
                _build_blend(plan, m.split, workers, progress)
    _BUILDING.clear()


def _build_blend(plan: Plan, i: int, workers: int, progress) -> None:
    start = time.perf_counter()
    dataset = plan.datasets()[i]
    size = dataset.size if dataset.size is not None else sum(dataset.weights)
    with _Workspace(plan.config.path_to_cache) as workspace:
        stem = _stem(dataset)
        arrays = [_npy_to_fill(os.path.join(workspace.path, f"{stem}-{name}.npy"), dtype, size)
                  for name, dtype in zip(_BLEND_INDICES, (np.int16, np.int64))]
        if dataset.size is None:
            counts = blend.exhaustive_blending_indices(dataset.weights, *arrays)
        else:
            counts = blend.blending_indices(dataset.weights, *arrays, workers)
        _check_not_oversampled(dataset, counts)
        for array in arrays:
            if isinstance(array, np.memmap):
                array.flush()
        del arrays
        with open(os.path.join(workspace.path, f"{stem}-description.txt"), "w") as f:
            f.write(dataset.unique_description)
        workspace.publish(stem)
    progress(f"{plan.name} blend of {len(plan.prefixes)} prefixes, {size:,} samples: "
             f"{time.perf_counter() - start:.1f} s")


def _npy_to_fill(path: str, dtype, size: int) -> np.ndarray:
    """A `.npy` file of `size` entries, mapped to be written in place (numpy cannot map an
    empty one: it is written whole, and an empty array returned)."""
    if size:
        return np.lib.format.open_memmap(path, "w+", dtype, (size,))
    np.save(path, np.zeros(0, dtype))
    return np.zeros(0, dtype)


def _check_not_oversampled(dataset: BlendedDataset, counts: np.ndarray) -> None:
    """megatron's check: no prefix asked for more samples than its dataset has."""
    for k, (member, count) in enumerate(zip(dataset.datasets, counts)):
        if count > len(member):
            raise RuntimeError(f"the {dataset.split.name} blend asks {count} samples of "
                               f"dataset {k}, which has {len(member)}")


# -- at the start of a run -------------------------------------------------------------------


def prepare(plans: list[Plan], rank: int, build_command: str,
            poll_s: float = 0.5) -> None:
    """Make sure the plans' indices are in the cache. All there: nothing else is read, no
    rank waits for another. Missing and quick to build: rank 0 builds them (the split's
    validation indices of a new rank count, a small corpus) while the others wait for
    their ready marks. Missing and long (past `BUILD_AT_START_LIMIT_S` on one core):
    refused on every rank alike, naming the command that builds them ahead of time."""
    missing = missing_of(plans)
    if not missing:
        return
    seconds = sum(plan.build_seconds(m) for plan, m in missing)
    cache = missing[0][0].config.path_to_cache
    if seconds > BUILD_AT_START_LIMIT_S:
        prefixes = {plan.prefixes[m.prefix].path: plan.prefixes[m.prefix].documents
                    for plan, ms in missing for m in ms if m.prefix is not None}
        raise UserError(
            f"data.cache_dir: the sample indices of this run's data ({sum(prefixes.values()):,} "
            f"documents in {len(prefixes)} prefixes) are not in {cache}; building them here "
            f"would keep rank 0 busy ~{seconds / 60:.0f} min while the other ranks wait: "
            f"build them first with {build_command}")
    if rank == 0:
        print(f"data cache: building {sum(len(m) for _, m in missing)} missing index(es) in "
              f"{cache} (~{seconds:.0f} s on one core)", flush=True)
        build([plan for plan, _ in missing])  # in this process: a rank forks no workers
        return
    _wait_for(rank, [plan for plan, _ in missing], cache, seconds, poll_s)


def _wait_for(rank: int, plans: list[Plan], cache: str, seconds: float, poll_s: float) -> None:
    """Until rank 0 has marked the plans' indices ready; said after a while, refused when
    far past what building them should take (a cache no other node sees)."""
    started, said = time.monotonic(), False
    limit = max(10 * seconds, 600.0)
    while not all(plan.ready() for plan in plans):
        waited = time.monotonic() - started
        if waited > limit:
            raise UserError(f"data.cache_dir: rank 0 has not built the data cache in {cache} "
                            f"after {waited / 60:.0f} min: is it on a filesystem every node "
                            "sees?")
        if waited > 30 and not said:
            print(f"rank {rank}: waiting for rank 0 to build the data cache in {cache}",
                  flush=True)
            said = True
        time.sleep(poll_s)
