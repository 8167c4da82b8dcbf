"""The analysis of one model (and optionally its dense baseline) on real text.

For every layer: the angular spread of one vector per distinct token of the text — the
token's row for a STEM layer, the up-projection output W_up x at the token's first
occurrence for a dense layer (what a row stands in for) — as statistics and a |cos|
histogram; the distinct-parameter curve of the text; the accounting report. All of it
JSON-able; `plots.py` draws it.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from megatron_stem.analysis.capacity import distinct_parameter_curve
from megatron_stem.analysis.spread import abs_cosines, sample_ids, spread
from megatron_stem.editing.forward import pad_batch
from megatron_stem.model.accounting import account, roi

HISTOGRAM_BINS = 50  # over |cos| in [0, 1]
_WINDOWS_PER_FORWARD = 8


def _first_positions(ids: Sequence[int], tokens: Sequence[int]) -> list[int]:
    first: dict[int, int] = {}
    for p, t in enumerate(ids):
        first.setdefault(t, p)
    return [first[t] for t in tokens]


def up_projection_vectors(backend, ids: Sequence[int],
                          positions: Sequence[int]) -> dict[int, torch.Tensor]:
    """Each dense layer's up-projection output at `positions` of the text, which is cut
    into independent windows of the model's sequence length. Only windows holding a
    wanted position run, and only the wanted rows are kept."""
    s = backend.config.seq_length
    wanted: dict[int, list[int]] = {}  # window -> its wanted positions
    for p in positions:
        wanted.setdefault(p // s, []).append(p)
    windows = sorted(wanted)
    out: dict[int, dict[int, torch.Tensor]] = {}
    for start in range(0, len(windows), _WINDOWS_PER_FORWARD):
        group = windows[start:start + _WINDOWS_PER_FORWARD]
        batch, _ = pad_batch([ids[w * s:(w + 1) * s] for w in group])
        for layer, up in backend.up_projections(batch).items():
            rows = out.setdefault(layer, {})
            for row, w in enumerate(group):
                for p in wanted[w]:
                    rows[p] = up[row, p % s]
    return {layer: torch.stack([rows[p] for p in positions]) for layer, rows in out.items()}


def layer_spreads(backend, ids: Sequence[int], rows: int, seed: int = 0) -> dict[str, dict]:
    """{layer: spread statistics + histogram} for every layer of the model."""
    tokens = sample_ids(list(dict.fromkeys(ids)), rows, seed)
    vectors = {layer: ("stem_rows", backend.read_rows(layer, tokens))
               for layer in backend.stem_layers}
    dense = up_projection_vectors(backend, ids, _first_positions(ids, tokens)) \
        if len(backend.stem_layers) < backend.config.num_layers else {}
    vectors.update({layer: ("up_projection", v) for layer, v in dense.items()})
    out = {}
    for layer in sorted(vectors):
        kind, v = vectors[layer]
        cos = abs_cosines(v)
        hist = torch.histc(cos, bins=HISTOGRAM_BINS, min=0.0, max=1.0)
        out[str(layer)] = {"kind": kind, **spread(v, cos).as_dict(),
                           "histogram": (hist / hist.sum()).tolist()}
    return out


def describe(backend) -> dict:
    acc = account(backend.config)
    return {"source": str(backend.source), "kind": backend.kind,
            "stem_layers": backend.stem_layers, "accounting": acc.as_dict(),
            "summary": acc.summary()}


def analyze(backend, ids: Sequence[int], rows: int = 1024, seed: int = 0, dense=None,
            accuracy: Optional[float] = None,
            dense_accuracy: Optional[float] = None) -> dict:
    """The report of `backend` (and `dense`, a baseline) on the text `ids`."""
    config = backend.config
    report = {"model": describe(backend), "text_tokens": len(ids),
              "distinct_tokens": len(set(ids)),
              "spread": layer_spreads(backend, ids, rows, seed)}
    if backend.stem_layers:
        report["capacity"] = distinct_parameter_curve(
            ids, len(backend.stem_layers), config.ffn_hidden_size, config.hidden_size).as_dict()
    if dense is not None:
        report["dense"] = {**describe(dense), "spread": layer_spreads(dense, ids, rows, seed)}
    if accuracy is not None and dense_accuracy is not None:
        acc = account(config)
        dense_flops = account(dense.config).flops_per_token if dense is not None \
            else 2 * acc.dense_params  # the dense baseline of the same shape
        report["roi"] = {"accuracy": accuracy, "dense_accuracy": dense_accuracy,
                         "flops_per_token": acc.flops_per_token,
                         "dense_flops_per_token": dense_flops,
                         "roi": roi(accuracy, acc.flops_per_token, dense_accuracy, dense_flops)}
    return report
