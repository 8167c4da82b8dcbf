"""Row writes: the one way edits change weights (injections, baked remaps).

An injection writes the rows of token(s) in chosen STEM layers from other rows:

- `copy`: token i of `inject` gets the rows of token i of `rows_of[0]` (or of its only
  token), e.g. give a new or rare token the memory of another;
- `average`: every token of `inject` gets the mean of the rows of all tokens of `rows_of`;
- `vectors`: given rows, per layer, from a file (`layer.<i>` -> [width] or [n, width]).

Writes are computed from the model as it was before any of them (so swaps work) and two
writes of one (layer, token) with different rows are refused.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megatron_stem.runtime.errors import UserError


@dataclass(frozen=True)
class RowWrite:
    layer: int
    token: int
    row: torch.Tensor  # [ffn_hidden_size]
    label: str  # the edit it comes from, for messages


@dataclass(frozen=True)
class TokenInject:
    """An injection resolved against a model and tokenizer (`resolve.py`)."""

    label: str
    tokens: tuple[int, ...]
    mode: str  # copy | average | vectors
    layers: tuple[int, ...]
    rows_of: tuple[tuple[int, ...], ...] = ()
    vectors: Optional[dict[int, torch.Tensor]] = None  # layer -> [width] or [n, width]


def inject_writes(backend, inject: TokenInject) -> list[RowWrite]:
    n, writes = len(inject.tokens), []
    for layer in inject.layers:
        if inject.mode == "vectors":
            rows = inject.vectors[layer].float().expand(n, -1)
        elif inject.mode == "average":
            pooled = [t for tokens in inject.rows_of for t in tokens]
            rows = backend.read_rows(layer, pooled).mean(0).expand(n, -1)
        else:
            rows = backend.read_rows(layer, inject.rows_of[0]).expand(n, -1)
        writes += [RowWrite(layer, token, rows[i], inject.label)
                   for i, token in enumerate(inject.tokens)]
    return writes


def check_conflicts(writes: Sequence[RowWrite]) -> None:
    seen: dict[tuple[int, int], RowWrite] = {}
    for w in writes:
        other = seen.setdefault((w.layer, w.token), w)
        if other is not w and not torch.equal(other.row, w.row):
            raise UserError(f"edits {other.label} and {w.label} both write token {w.token}'s "
                            f"row in layer {w.layer}, differently")


def apply_writes(backend, writes: Sequence[RowWrite]) -> list[RowWrite]:
    """Write the rows; return the writes that undo them (the previous rows)."""
    check_conflicts(writes)
    undo = [RowWrite(w.layer, w.token, backend.read_rows(w.layer, [w.token])[0], w.label)
            for w in writes]
    for w in writes:
        backend.write_rows(w.layer, [w.token], w.row[None])
    return undo[::-1]


@contextlib.contextmanager
def written(backend, writes: Sequence[RowWrite]):
    """The rows written for the duration of the block, then restored exactly (and not
    counted as edits: saving afterwards rewrites only layers really edited)."""
    edited = set(backend.edited_layers)
    undo = apply_writes(backend, writes) if writes else []
    try:
        yield
    finally:
        for w in undo:
            backend.write_rows(w.layer, [w.token], w.row[None])
        backend.edited_layers = edited
