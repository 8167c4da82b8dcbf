"""Edit specs -> token ids and layers of one model, with the checks that need the model:
texts become ids with the model's tokenizer, layers must be STEM layers, ids must be in
the vocabulary, token counts must suit the strategy. Errors name the spec item."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import torch

from megatron_stem.config import ModelConfig
from megatron_stem.editing.inject import TokenInject
from megatron_stem.editing.remap import TokenRemap, span_plan
from megatron_stem.editing.spec import Edit, Inject, Remap, Tokens
from megatron_stem.runtime.errors import UserError


def encode(tokenizer, tokens: Tokens, vocab_size: int, where: str) -> tuple[int, ...]:
    if isinstance(tokens, str):
        if tokenizer is None:
            raise UserError(f"{where}: text needs a tokenizer (or give token ids)")
        ids = tuple(tokenizer.encode(tokens))
        if not ids:
            raise UserError(f"{where}: {tokens!r} encodes to no tokens")
    else:
        ids = tuple(tokens)
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise UserError(f"{where}: token id {bad[0]} is outside the vocabulary "
                        f"(0..{vocab_size - 1})")
    return ids


def stem_layers(layers: Optional[Sequence[int]], model: ModelConfig, where: str) -> tuple[int, ...]:
    stem = model.stem_layer_indices
    if layers is None:
        return tuple(stem)
    other = [i for i in layers if i not in stem]
    if other:
        raise UserError(f"{where}.layers: layer {other[0]} is not a STEM layer (STEM layers: "
                        f"{stem or 'none'})")
    return tuple(sorted(layers))


def _pad_token(tokenizer) -> Optional[int]:
    if tokenizer is None:
        return None
    return tokenizer.pad if tokenizer.pad is not None else tokenizer.eod


def resolve_remap(remap: Remap, tokenizer, model: ModelConfig, where: str,
                  label: str = "") -> TokenRemap:
    vocab = model.vocab_size
    source = encode(tokenizer, remap.source, vocab, f"{where}.source")
    target = encode(tokenizer, remap.target, vocab, f"{where}.target")
    pad = _pad_token(tokenizer)
    if remap.pad is not None:
        ids = encode(tokenizer, remap.pad, vocab, f"{where}.pad")
        if len(ids) != 1:
            raise UserError(f"{where}.pad: {remap.pad!r} is {len(ids)} tokens, not one")
        pad = ids[0]
    try:
        span_plan(len(source), target, remap.strategy, pad)
    except ValueError as e:
        hint = " (set `pad`)" if "pad token" in str(e) else \
            "; choose pad_left, pad_right, subset, copy or average"
        raise UserError(f"{where}.strategy: {remap.label}: {e}{hint}") from None
    return TokenRemap(label or remap.label, source, target, remap.strategy,
                      stem_layers(remap.layers, model, where), pad,
                      tuple(remap.occurrences) if remap.occurrences is not None else None)


def _read_vectors(path: str, where: str) -> dict[str, torch.Tensor]:
    file = Path(path)
    if not file.is_file():
        raise UserError(f"{where}.vectors: {path}: no such file")
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file
            data = load_file(str(file))
        else:
            data = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # torch and safetensors raise many kinds on a bad file
        raise UserError(f"{where}.vectors: {path}: not a tensor file ({e})") from None
    if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise UserError(f"{where}.vectors: {path}: expected a mapping of 'layer.<i>' to tensors")
    return data


def resolve_inject(inject: Inject, tokenizer, model: ModelConfig, where: str,
                   label: str = "") -> TokenInject:
    vocab, width = model.vocab_size, model.ffn_hidden_size
    tokens = encode(tokenizer, inject.inject, vocab, f"{where}.inject")
    rows_of = tuple(encode(tokenizer, t, vocab, f"{where}.rows_of[{i}]")
                    for i, t in enumerate(inject.rows_of))
    if inject.mode == "copy" and len(rows_of[0]) not in (1, len(tokens)):
        raise UserError(f"{where}.rows_of: copy gives each of the {len(tokens)} injected "
                        f"tokens one row: rows_of[0] must be 1 or {len(tokens)} tokens, not "
                        f"{len(rows_of[0])} (use mode 'average' to mix)")
    vectors = None
    layers = stem_layers(inject.layers, model, where)
    if inject.mode == "vectors":
        data = _read_vectors(inject.vectors, where)
        vectors = {}
        for key, value in data.items():
            head, _, index = key.partition(".")
            if head != "layer" or not index.isdigit():
                raise UserError(f"{where}.vectors: {key}: expected keys 'layer.<i>'")
            if value.shape not in ((width,), (len(tokens), width)):
                raise UserError(f"{where}.vectors: {key} has shape {tuple(value.shape)}; "
                                f"expected ({width},) or ({len(tokens)}, {width})")
            vectors[int(index)] = value
        layers = stem_layers(inject.layers if inject.layers is not None else sorted(vectors),
                             model, where)
        missing = [i for i in layers if i not in vectors]
        if missing:
            raise UserError(f"{where}.vectors: no 'layer.{missing[0]}' in {inject.vectors}")
    return TokenInject(label or inject.label, tokens, inject.mode, layers, rows_of, vectors)


def resolve(edits: Sequence[Edit], tokenizer, model: ModelConfig,
            where: str = "edits") -> tuple[list[TokenRemap], list[TokenInject]]:
    """The remaps and injections of a spec, for this model; `where` names the spec."""
    if not model.is_stem:
        raise UserError(f"{where}: the model has no STEM layers: there are no rows to remap "
                        "or inject")
    remaps, injects = [], []
    for i, edit in enumerate(edits):
        item, label = f"{where}: [{i}]", f"[{i}] {edit.label}"
        if isinstance(edit, Remap):
            remaps.append(resolve_remap(edit, tokenizer, model, item, label))
        else:
            injects.append(resolve_inject(edit, tokenizer, model, item, label))
    return remaps, injects
