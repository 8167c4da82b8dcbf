"""Remapping STEM lookups: which rows each position of an occurrence of `source` reads.

A remap of n source tokens onto m target tokens is a plan of n entries, one per source
position: a token id (read that token's rows), a tuple of ids (read the mean of their
rows), or None (keep the position's own rows). Strategies:

| strategy   | n > m (source longer)                         | n < m (target longer) |
|------------|-----------------------------------------------|-----------------------|
| one_to_one | refused                                       | refused               |
| pad_left   | the first n-m positions read the pad token    | the last n of t       |
| pad_right  | the last n-m positions read the pad token     | the first n of t      |
| subset     | only the last m positions move, others keep   | the last n of t       |
| copy       | t stretched: position i reads t[i*m//n]       | i reads t[i*m//n]     |
| average    | every position reads the mean of t's rows     | the same              |

With n == m every strategy but `average` reads t[i] at position i.

At inference time the plan becomes a per-layer `stem_ids` tensor for a batch (every
occurrence of the source, or the chosen ones, in the chosen layers); the input ids are
never touched. Averaged rows are not rows of the table: they travel as placeholder ids
(>= vocab_size) that `forward.py` resolves.

Baking (`bake_writes`) turns a plan into row writes: U_l[source token] := the row its
position reads, in each chosen layer. That is the same model for every text in which the
source tokens occur only as that span; elsewhere (a source token inside another word or
name) the baked edit reaches too, the inference-time one does not. A remap whose
source repeats a token with different targets, or that picks occurrences, has no such
row-level form and stays inference-time only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from megatron_stem.editing.inject import RowWrite
from megatron_stem.runtime.errors import UserError

Row = Union[int, tuple[int, ...], None]


def span_plan(n: int, target: Sequence[int], strategy: str, pad: Optional[int]) -> list[Row]:
    """What each of n source positions reads (see the module table)."""
    m, target = len(target), tuple(target)
    if strategy == "average":
        return [target if m > 1 else target[0]] * n
    if strategy == "one_to_one":
        if n != m:
            raise ValueError(f"one_to_one needs as many target tokens as source tokens "
                             f"({n} vs {m})")
        return list(target)
    if strategy == "copy":
        return [target[i * m // n] for i in range(n)]
    right_aligned = strategy in ("pad_left", "subset")
    if m >= n:
        return list(target[m - n:] if right_aligned else target[:n])
    if strategy == "subset":
        fill = None
    elif pad is None:
        raise ValueError(f"{strategy} pads {n - m} position(s) and no pad token is known")
    else:
        fill = pad
    padding = [fill] * (n - m)
    return padding + list(target) if right_aligned else list(target) + padding


@dataclass(frozen=True)
class TokenRemap:
    """A remap resolved against a model and tokenizer (`resolve.py`)."""

    label: str
    source: tuple[int, ...]
    target: tuple[int, ...]
    strategy: str
    layers: tuple[int, ...]  # 0-based global STEM layers
    pad: Optional[int] = None
    occurrences: Optional[tuple[int, ...]] = None  # None: every occurrence

    def plan(self) -> list[Row]:
        return span_plan(len(self.source), self.target, self.strategy, self.pad)


def find_occurrences(ids: Sequence[int], source: Sequence[int]) -> list[int]:
    """Start positions of the non-overlapping occurrences of `source` in `ids`."""
    n, found, i = len(source), [], 0
    source = list(source)
    while i + n <= len(ids):
        if list(ids[i:i + n]) == source:
            found.append(i)
            i += n
        else:
            i += 1
    return found


@dataclass
class StemIds:
    """Per-layer lookup ids of a batch under remaps."""

    ids: Optional[torch.Tensor]  # [num_layers, b, s]; None: nothing remapped (plain lookups)
    averages: dict[int, tuple[int, ...]]  # placeholder id -> the ids whose rows it averages
    hits: list[list[int]]  # per row, per remap: occurrences remapped


def build_stem_ids(batch: torch.Tensor, lengths: Sequence[int],
                   remaps_per_row: Sequence[Sequence[TokenRemap]], num_layers: int,
                   vocab_size: int) -> StemIds:
    """Lookup ids for a right-padded batch [b, s]: row r's remaps apply to its first
    lengths[r] tokens. Two remaps claiming one (layer, position) is an error."""
    ids = batch.unsqueeze(0).repeat(num_layers, 1, 1)
    owner: dict[tuple[int, int, int], str] = {}
    averages: dict[tuple[int, ...], int] = {}
    hits, changed = [], False
    for r, remaps in enumerate(remaps_per_row):
        seq = batch[r, :lengths[r]].tolist()
        row_hits = []
        for remap in remaps:
            starts = find_occurrences(seq, remap.source)
            if remap.occurrences is not None:
                starts = [p for k, p in enumerate(starts) if k in remap.occurrences]
            row_hits.append(len(starts))
            plan = remap.plan()
            for start in starts:
                for i, row in enumerate(plan):
                    if row is None:
                        continue
                    if isinstance(row, tuple):
                        row = averages.setdefault(row, vocab_size + len(averages))
                    for layer in remap.layers:
                        key = (layer, r, start + i)
                        if key in owner and owner[key] != remap.label:
                            raise UserError(f"edits {owner[key]} and {remap.label} both remap "
                                            f"position {start + i} in layer {layer}")
                        owner[key] = remap.label
                        ids[layer, r, start + i] = row
                        changed = True
        hits.append(row_hits)
    return StemIds(ids if changed else None, {v: k for k, v in averages.items()}, hits)


def bake_writes(backend, remaps: Sequence[TokenRemap]) -> list[RowWrite]:
    """Row writes equivalent to `remaps` (see the module doc); every row is read from the
    model as it is before any of them is written."""
    writes = []
    for remap in remaps:
        if remap.occurrences is not None:
            raise UserError(f"{remap.label}: `occurrences` picks positions in a text; such a "
                            "remap exists only at inference time and cannot be baked")
        wanted: dict[int, Row] = {}
        for token, row in zip(remap.source, remap.plan()):
            if row is None:
                continue
            if wanted.get(token, row) != row:
                raise UserError(f"{remap.label}: source token {token} occurs twice with "
                                "different targets; a table has one row per token, so this "
                                "remap exists only at inference time")
            wanted[token] = row
        for layer in remap.layers:
            for token, row in wanted.items():
                ids = list(row) if isinstance(row, tuple) else [row]
                writes.append(RowWrite(layer, token, backend.read_rows(layer, ids).mean(0),
                                       remap.label))
    return writes
