"""The training data a recipe names, resolved to megatron `.bin/.idx` prefixes.

A recipe's data entry (`data.prefixes`, a data recipe's `sources[].prefix`, a validation
set) is either one prefix, or a *prefix set*: the folder that preprocessing writes for a
corpus, holding prefixes of bounded size and a `manifest.json` that lists them in corpus
order with their document and token counts (docs/data.md, "Prefix sets"). A weighted
source's weight is split over its set's prefixes by their tokens, so the set is sampled
as one corpus would be.

Every prefix is checked here, before any rank builds anything: megatron-core 0.16 holds
document ids as int32 (`numpy.arange(..., dtype=int32)` over a split's documents, the
document index `astype(int32)`, `helpers.cpp`), so a prefix of 2**31 documents or more
would wrap to negative ids and read out of bounds.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable, Optional

from megatron_stem.data.indexed import bin_path, idx_path, read_header
from megatron_stem.errors import UserError

MANIFEST = "manifest.json"
# The most documents one prefix may hold: megatron-core's document ids are int32.
MAX_DOCUMENTS = 2**31 - 1


@dataclass(frozen=True)
class Prefix:
    path: str  # without .bin/.idx
    documents: int
    tokens: Optional[int] = None  # known when a manifest lists it


def is_prefix_set(entry: str) -> bool:
    return os.path.isdir(entry)


def read_manifest(folder: str, field: str) -> list[Prefix]:
    """The prefixes of a prefix set, in corpus order; `field` names the recipe field."""
    path = os.path.join(folder, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
        prefixes = [Prefix(os.path.join(folder, p["name"]), int(p["documents"]),
                           int(p["tokens"])) for p in manifest["prefixes"]]
    except FileNotFoundError:
        raise UserError(f"{field}: {folder} has no {MANIFEST}: preprocessing of this prefix "
                        "set has not finished (run its --merge-only step)") from None
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{field}: {path} is not a prefix-set manifest ({e})") from None
    if not prefixes:
        raise UserError(f"{field}: {path} lists no prefixes")
    return prefixes


def _single(prefix: str, field: str) -> Prefix:
    missing = [p for p in (bin_path(prefix), idx_path(prefix)) if not os.path.isfile(p)]
    if missing:
        raise UserError(f"{field}: {missing[0]} not found (give the path without .bin/.idx, "
                        "or a prefix-set folder, as written by preprocess_data.py)")
    return Prefix(prefix, read_header(idx_path(prefix)).sequences)


def resolve(entry: str, field: str) -> list[Prefix]:
    """The prefixes of one data entry, each checked to exist and to fit megatron's ids
    (the count its `.idx` header gives)."""
    if not is_prefix_set(entry):
        prefixes = [_single(entry, field)]
    else:
        listed = read_manifest(entry, field)
        prefixes = [Prefix(p.path, _single(p.path, f"{field} ({entry}/{MANIFEST})").documents,
                           p.tokens) for p in listed]
    for prefix in prefixes:
        check_documents(prefix, field)
    return prefixes


def check_documents(prefix: Prefix, field: str) -> None:
    if prefix.documents > MAX_DOCUMENTS:
        raise UserError(
            f"{field}: {prefix.path} holds {prefix.documents:,} documents, more than "
            f"megatron-core's int32 document ids allow ({MAX_DOCUMENTS:,}); write the corpus "
            "as a prefix set instead (preprocess_data.py without --single-prefix, "
            "--prefix-max-documents) and name its folder")


def resolve_blend(entries: list[str], weights: Optional[list[float]],
                  field: Callable[[int], str]) -> tuple[list[Prefix], Optional[list[float]]]:
    """(prefixes, weights) of weighted entries, a set's weight split over its prefixes by
    their tokens. Without weights, megatron samples every prefix in proportion to its size
    (its samples), so a set needs no weights either."""
    prefixes, split = [], []
    for i, entry in enumerate(entries):
        resolved = resolve(entry, field(i))
        prefixes += resolved
        if weights is not None and len(resolved) == 1:
            split.append(weights[i])
        elif weights is not None:
            total = sum(p.tokens for p in resolved)
            split += [weights[i] * p.tokens / total for p in resolved]
    return prefixes, (split if weights is not None else None)
