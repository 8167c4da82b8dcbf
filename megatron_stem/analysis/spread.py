"""Angular spread: how far apart in direction a set of vectors is.

The STEM paper reads a table's angular spread as its capacity to store distinct things:
rows that point in many directions interfere little when mixed by the gate. We measure
it as the distribution of |cos| over all pairs of sampled vectors (rows of a table, or a
dense layer's up-projection outputs): near 0 is wide spread (orthogonal rows give 0),
near 1 is collapse. The yardstick is random Gaussian vectors of the same width, whose
cosine is about N(0, 1/width), so P95 |cos| ~ 1.96 / sqrt(width).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import torch

Z95 = 1.959964  # P(|N(0, 1)| < Z95) = 0.95


@dataclass(frozen=True)
class Spread:
    vectors: int
    width: int
    pairs: int
    mean_abs_cos: float
    p50: float
    p95: float
    p99: float
    gaussian_p95: float  # random Gaussian vectors of this width: Z95 / sqrt(width)

    def as_dict(self) -> dict:
        return asdict(self)


def abs_cosines(vectors: torch.Tensor) -> torch.Tensor:
    """|cos| of every pair of distinct vectors [n, width] (zero vectors dropped), flat."""
    vectors = vectors.float()
    norms = vectors.norm(dim=1)
    unit = vectors[norms > 0] / norms[norms > 0, None]
    cos = unit @ unit.T
    i, j = torch.triu_indices(len(unit), len(unit), offset=1)
    return cos[i, j].abs()


def spread(vectors: torch.Tensor, cosines: Optional[torch.Tensor] = None) -> Spread:
    cosines = abs_cosines(vectors) if cosines is None else cosines
    if cosines.numel() == 0:
        raise ValueError("angular spread needs at least two non-zero vectors")
    q = torch.quantile(cosines.double(), torch.tensor([0.5, 0.95, 0.99], dtype=torch.float64))
    width = vectors.shape[1]
    n = round((1 + math.sqrt(1 + 8 * cosines.numel())) / 2)
    return Spread(n, width, cosines.numel(), float(cosines.mean()), *map(float, q),
                  Z95 / math.sqrt(width))


def sample_ids(candidates: Sequence[int], count: int, seed: int = 0) -> list[int]:
    """Up to `count` of `candidates`, a fixed random choice (all of them if fewer)."""
    candidates = list(candidates)
    if len(candidates) <= count:
        return candidates
    g = torch.Generator().manual_seed(seed)
    return [candidates[i] for i in torch.randperm(len(candidates), generator=g)[:count].tolist()]
