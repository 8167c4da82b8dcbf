"""A blend's indices (data/blend.py, data/csrc/blend.c) are megatron-core's own: its
`build_blending_indices` and `build_exhaustive_blending_indices` give the same arrays, on
random weights and sizes, on the 1T stage's 195 prefixes, in chunks on several threads
(whether a chunk's guessed start holds or it is run again)."""

import numpy as np
import pytest
from megatron.core.datasets import helpers

from megatron_stem.data import blend


def megatrons(weights: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    index, sample = np.zeros(size, np.int16), np.zeros(size, np.int64)
    helpers.build_blending_indices(index, sample, weights, len(weights), size, False)
    return index, sample


def ours(weights: np.ndarray, size: int, workers: int = 1):
    index, sample = np.full(size, -1, np.int16), np.full(size, -1, np.int64)
    counts = blend.blending_indices(weights, index, sample, workers)
    return index, sample, counts


def random_weights(rng, n: int) -> np.ndarray:
    """Uniform, skewed, equal or of near-equal pairs: the shapes that tie or cross."""
    kind = rng.integers(4)
    w = [rng.random(n), rng.random(n) ** 6 + 1e-4, np.ones(n),
         np.repeat(rng.random((n + 1) // 2), 2)[:n] + rng.random(n) * 1e-12][kind]
    return w / w.sum()


def test_the_same_indices_as_megatrons_on_random_blends():
    rng = np.random.default_rng(0)
    for _ in range(150):
        n, size = int(rng.integers(1, 260)), int(rng.integers(1, 20_000))
        weights = random_weights(rng, n)
        index, sample, counts = ours(weights, size)
        want_index, want_sample = megatrons(weights, size)
        np.testing.assert_array_equal(index, want_index)
        np.testing.assert_array_equal(sample, want_sample)
        np.testing.assert_array_equal(counts, np.bincount(want_index, minlength=n))


def stage_weights(rng) -> np.ndarray:
    """The 1T stage's 195 prefixes of OLMo-Mix: 20B tokens each but a group's last."""
    tokens = rng.uniform(19.5e9, 20e9, 195)
    tokens[rng.choice(195, 64, replace=False)] = rng.uniform(0.5e9, 20e9, 64)
    return tokens / tokens.sum()


def test_the_same_indices_as_megatrons_on_195_prefixes():
    weights = stage_weights(np.random.default_rng(1))
    index, sample, _ = ours(weights, 300_000)
    want_index, want_sample = megatrons(weights, 300_000)
    np.testing.assert_array_equal(index, want_index)
    np.testing.assert_array_equal(sample, want_sample)


@pytest.mark.parametrize("warmup", [0, 100, blend.WARMUP], ids=["no-warmup", "short", "default"])
def test_chunks_on_threads_give_the_same_indices(monkeypatch, warmup):
    """Without a warmup a chunk's guessed start is wrong and it is run again; with one it
    usually holds. Either way, the indices are megatron's."""
    monkeypatch.setattr(blend, "MIN_CHUNK", 5_000)
    monkeypatch.setattr(blend, "WARMUP", warmup)
    rng = np.random.default_rng(2)
    for weights in (stage_weights(rng), random_weights(rng, 7), random_weights(rng, 40)):
        index, sample, counts = ours(weights, 60_000, workers=5)
        want_index, want_sample = megatrons(weights, 60_000)
        np.testing.assert_array_equal(index, want_index)
        np.testing.assert_array_equal(sample, want_sample)
        np.testing.assert_array_equal(counts, np.bincount(want_index, minlength=len(weights)))


def test_the_exhaustive_blend_is_megatrons():
    rng = np.random.default_rng(3)
    for _ in range(40):
        sizes = rng.integers(1, 600, int(rng.integers(1, 60)))
        total = int(sizes.sum())
        want_index, want_sample = np.zeros(total, np.int16), np.zeros(total, np.int64)
        helpers.build_exhaustive_blending_indices(want_index, want_sample, sizes, len(sizes))
        index, sample = np.zeros(total, np.int16), np.zeros(total, np.int64)
        counts = blend.exhaustive_blending_indices(sizes, index, sample)
        np.testing.assert_array_equal(index, want_index)
        np.testing.assert_array_equal(sample, want_sample)
        np.testing.assert_array_equal(counts, sizes)


def test_the_weights_counts_sum_to_the_sample_and_round_the_products():
    weights = stage_weights(np.random.default_rng(4))
    for sample in (0, 1, 77, 123_457):
        counts = blend.counts_at(weights, sample)
        assert counts.sum() == sample
        assert np.all(np.abs(counts - weights * sample) < 1)
