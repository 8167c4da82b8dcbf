"""Distinct STEM parameters a context activates, against its length.

A dense FFN uses the same weights for every token. A STEM layer reads one table row per
token id, so a context of n tokens with u(n) distinct ids touches u(n) x width parameters
in each STEM layer: the model's parametric memory in use grows with the context (the
paper's test-time capacity scaling) and stops growing when the text repeats itself.
`dense_up_params` is what the up-projections STEM replaced hold (k x d x width), all of
which every token of a dense model touches: the curve crosses it once the context has
more than d distinct ids.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class CapacityCurve:
    lengths: list[int]
    distinct_ids: list[int]
    stem_params: list[int]  # distinct_ids x stem layers x width
    params_per_id: int
    dense_up_params: int

    def as_dict(self) -> dict:
        return asdict(self)


def default_lengths(total: int) -> list[int]:
    """Powers of two up to `total`, and `total`."""
    lengths, n = [], 1
    while n < total:
        lengths.append(n)
        n *= 2
    return lengths + [total]


def distinct_parameter_curve(ids: Sequence[int], stem_layers: int, width: int, hidden: int,
                             lengths: Optional[Sequence[int]] = None) -> CapacityCurve:
    """u(n) and u(n) x stem_layers x width for each prefix length n of `ids`."""
    lengths = sorted(set(lengths or default_lengths(len(ids))))
    if not ids or lengths[-1] > len(ids) or lengths[0] < 1:
        raise ValueError(f"lengths must lie in 1..{len(ids)}")
    seen, distinct, i = set(), [], 0
    for n in lengths:
        seen.update(ids[i:n])
        i = n
        distinct.append(len(seen))
    per_id = stem_layers * width
    return CapacityCurve(list(lengths), distinct, [u * per_id for u in distinct], per_id,
                         stem_layers * hidden * width)
