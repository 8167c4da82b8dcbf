"""A blend's indices (which prefix each sample comes from, and its sample number there),
the same as megatron-core's, built without megatron's cost in the number of prefixes.

megatron's `BlendedDataset` builds them with `helpers.build_blending_indices`: at every
sample it compares every prefix's error, O(samples x prefixes) in one thread; at the 1T
stage's 488M samples of 195 prefixes, the longest part of the cache build. Here:

- `csrc/blend.c` computes the same numbers (the same comparisons on the same doubles,
  tested against megatron's on random weights and sizes) comparing a few prefixes a
  sample, those whose errors are near the largest (its header says why that is exact);
- the samples are cut into one chunk per worker thread, run at once. A chunk needs each
  prefix's count at its start: it starts from the counts the weights alone give a while
  before (the largest-remainder rounding) and runs up to its start (the blend forgets
  where it started within a few hundred samples); it is kept only if its counts there are
  those its predecessor ended with, and run again from them otherwise. The result never
  depends on the workers.
"""

from __future__ import annotations

import ctypes
import functools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from megatron_stem.runtime import jit_ops

SOURCE = Path(__file__).parent / "csrc" / "blend.c"
WARMUP = 1 << 16  # samples a chunk runs before its start, from the weights' counts
MIN_CHUNK = 1 << 20  # samples: fewer are not worth a thread


@functools.cache
def kernel():
    """`stem_blend` of csrc/blend.c, compiled on first use (tools/build_ops.py builds it)."""
    library = jit_ops.load_library(SOURCE, "the data cache's blend")
    array = functools.partial(np.ctypeslib.ndpointer, flags="C_CONTIGUOUS")
    blend = library.stem_blend
    blend.restype = ctypes.c_int
    blend.argtypes = [array(np.float64), ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64,
                      ctypes.c_int64, array(np.int64), ctypes.c_void_p, ctypes.c_void_p]
    return blend


def _address(array: Optional[np.ndarray], dtype) -> Optional[int]:
    if array is None:
        return None
    assert array.dtype == dtype and array.flags.c_contiguous
    return array.ctypes.data


def _run(weights: np.ndarray, caps: Optional[np.ndarray], start: int, counts: np.ndarray,
         dataset_index: Optional[np.ndarray], dataset_sample_index: Optional[np.ndarray],
         count: int) -> None:
    """Samples [start, start + count) into the arrays (None: the counts only)."""
    if kernel()(weights, len(weights), _address(caps, np.int64), start, count, counts,
                _address(dataset_index, np.int16),
                _address(dataset_sample_index, np.int64)) != 0:
        raise MemoryError("the blend's kernel ran out of memory")


def counts_at(weights: np.ndarray, sample: int) -> np.ndarray:
    """Each prefix's samples before `sample` by the weights alone: the floors of
    weight x sample, one more for the largest remainders, as many as make `sample`."""
    exact = weights * sample
    counts = np.floor(exact).astype(np.int64)
    short = int(np.clip(sample - counts.sum(), 0, len(weights)))
    counts[np.argsort(counts - exact, kind="stable")[:short]] += 1
    return counts


def blending_indices(weights: Sequence[float], dataset_index: np.ndarray,
                     dataset_sample_index: np.ndarray, workers: int = 1) -> np.ndarray:
    """Fill `dataset_index` (int16) and `dataset_sample_index` (int64), of one length, as
    megatron's `build_blending_indices` with these (normalized) weights does; each
    prefix's samples. The arrays may be memory maps of the files they go to."""
    weights = np.ascontiguousarray(weights, np.float64)
    size = len(dataset_index)
    chunks = max(1, min(workers, size // MIN_CHUNK))
    bounds = [size * k // chunks for k in range(chunks + 1)]

    def chunk(k: int) -> tuple[np.ndarray, np.ndarray]:
        start, end = bounds[k], bounds[k + 1]
        warmup = min(start, WARMUP)
        counts = counts_at(weights, start - warmup) if k else np.zeros(len(weights), np.int64)
        _run(weights, None, start - warmup, counts, None, None, warmup)
        begun = counts.copy()
        _run(weights, None, start, counts, dataset_index[start:end],
             dataset_sample_index[start:end], end - start)
        return begun, counts

    with ThreadPoolExecutor(chunks) as pool:  # the kernel runs without the GIL
        results = list(pool.map(chunk, range(chunks)))
    counts = results[0][1]
    for k in range(1, chunks):
        begun, ended = results[k]
        if not np.array_equal(begun, counts):  # it started elsewhere: run it again
            ended = counts.copy()
            start, end = bounds[k], bounds[k + 1]
            _run(weights, None, start, ended, dataset_index[start:end],
                 dataset_sample_index[start:end], end - start)
        counts = ended
    return counts


def exhaustive_blending_indices(sizes: Sequence[int], dataset_index: np.ndarray,
                                dataset_sample_index: np.ndarray) -> np.ndarray:
    """As megatron's `build_exhaustive_blending_indices`: every sample of every prefix
    (`sizes`), blended by size; the arrays hold sum(sizes). Each prefix's samples."""
    caps = np.ascontiguousarray(sizes, np.int64)
    weights = caps / float(caps.sum())
    counts = np.zeros(len(caps), np.int64)
    _run(weights, caps, 0, counts, dataset_index, dataset_sample_index, len(dataset_index))
    return counts
