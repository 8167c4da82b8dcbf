"""Edit specs: what a user asks for, loaded from YAML or JSON in strict mode.

An edit spec is a list; each item is either a remap (it has `source`) or an injection (it
has `inject`):

    - source: Spain              # text (or a list of token ids) whose STEM lookups move
      target: Germany            # the token(s) whose rows they read instead
      strategy: one_to_one       # how n source tokens read m target tokens (remap.py)
      layers: [1, 4]             # 0-based STEM layers; default every STEM layer
    - inject: Atlantis           # token(s) whose rows are written
      mode: average              # copy | average | vectors
      rows_of: [Spain, Portugal] # copy/average: the tokens whose rows are used
      # vectors: rows.safetensors  mode vectors: tensors "layer.<i>", [width] or [n, width]

Loading checks names, types and the rules that need no model; the rules that do (token
counts, which layers are STEM, vocabulary) are checked when the edits are resolved against
a model and tokenizer (`resolve.py`). Every error names the file, the item and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Union

import yaml

from megatron_stem.config import from_dict
from megatron_stem.runtime.errors import ConfigError, UserError

# Text (encoded with the model's tokenizer, no special tokens added) or explicit token ids.
Tokens = Union[str, list[int]]
Strategy = Literal["one_to_one", "pad_left", "pad_right", "copy", "subset", "average"]


@dataclass
class Remap:
    """The STEM lookups at every occurrence of `source` read `target`'s rows; the text (and
    everything else the model computes from it) is unchanged."""

    source: Tokens
    target: Tokens
    strategy: Strategy = "one_to_one"
    layers: Optional[list[int]] = None
    # The token padded positions read (pad_left, pad_right); default the tokenizer's pad,
    # else its end-of-document token.
    pad: Optional[Tokens] = None
    # Which occurrences of `source` in a sequence (0-based, in order) are remapped; default
    # all. Position-dependent, so such a remap exists only at inference time.
    occurrences: Optional[list[int]] = None

    def validate(self) -> None:
        _check_tokens(self.source, "source")
        _check_tokens(self.target, "target")
        if self.pad is not None:
            _check_tokens(self.pad, "pad")
            if self.strategy not in ("pad_left", "pad_right"):
                raise ConfigError(f"pad: only the pad_left and pad_right strategies pad, "
                                  f"not {self.strategy}")
        if self.occurrences is not None and (not self.occurrences
                                             or min(self.occurrences) < 0):
            raise ConfigError(f"occurrences: expected 0-based indices, got {self.occurrences}")
        _check_layers(self.layers)

    @property
    def label(self) -> str:
        return f"{_show(self.source)} -> {_show(self.target)}"


@dataclass
class Inject:
    """Write the rows of token(s) `inject` in chosen STEM layers."""

    inject: Tokens
    mode: Literal["copy", "average", "vectors"] = "copy"
    rows_of: list[Tokens] = field(default_factory=list)
    vectors: Optional[str] = None  # a .safetensors or .pt file, relative to the spec file
    layers: Optional[list[int]] = None

    def validate(self) -> None:
        _check_tokens(self.inject, "inject")
        for i, tokens in enumerate(self.rows_of):
            _check_tokens(tokens, f"rows_of[{i}]")
        if self.mode == "vectors":
            if self.vectors is None:
                raise ConfigError("vectors: mode 'vectors' needs a vectors file")
            if self.rows_of:
                raise ConfigError("rows_of: mode 'vectors' takes its rows from `vectors`")
        else:
            if self.vectors is not None:
                raise ConfigError(f"vectors: only mode 'vectors' reads a file, not {self.mode}")
            if not self.rows_of:
                raise ConfigError(f"rows_of: mode '{self.mode}' needs the tokens whose rows "
                                  "to use")
            if self.mode == "copy" and len(self.rows_of) != 1:
                raise ConfigError(f"rows_of: mode 'copy' takes one entry, got "
                                  f"{len(self.rows_of)} (use mode 'average' to mix)")
        _check_layers(self.layers)

    @property
    def label(self) -> str:
        what = self.vectors if self.mode == "vectors" else \
            " + ".join(_show(t) for t in self.rows_of)
        return f"inject {_show(self.inject)} <- {self.mode} {what}"


Edit = Union[Remap, Inject]


def _show(tokens: Tokens) -> str:
    return repr(tokens) if isinstance(tokens, str) else str(tokens)


def _check_tokens(tokens: Tokens, name: str) -> None:
    if isinstance(tokens, str) and not tokens.strip():
        raise ConfigError(f"{name}: empty text")
    if isinstance(tokens, list) and (not tokens or min(tokens) < 0):
        raise ConfigError(f"{name}: expected a non-empty list of token ids, got {tokens}")


def _check_layers(layers: Optional[list[int]]) -> None:
    if layers is not None and (not layers or len(set(layers)) != len(layers)):
        raise ConfigError(f"layers: expected distinct layer indices, got {layers}")


def parse_edits(items, where: str) -> list[Edit]:
    """Typed edits from a list of mappings; `where` names the source in errors."""
    if isinstance(items, dict) and set(items) == {"edits"}:
        items = items["edits"]
    if not isinstance(items, list) or not items:
        raise UserError(f"{where}: an edit spec is a non-empty list of edits")
    edits = []
    for i, item in enumerate(items):
        label = f"{where}: [{i}]."
        if not isinstance(item, dict):
            raise UserError(f"{label.rstrip('.')}: expected a mapping, got {item!r}")
        if ("source" in item) == ("inject" in item):
            raise UserError(f"{label.rstrip('.')}: an edit has either `source` (a remap) or "
                            "`inject` (an injection)")
        edits.append(from_dict(Remap if "source" in item else Inject, item, label))
    return edits


def read_structured(path: str | Path):
    """A YAML or JSON file's content (JSON is YAML, but its errors read better as JSON)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    text = path.read_text()
    try:
        return json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        kind = "JSON" if path.suffix == ".json" else "YAML"
        raise UserError(f"{path}: not valid {kind} ({' '.join(str(e).split())})") from None


def load_edits(path: str | Path) -> list[Edit]:
    """The edits of a spec file. Relative `vectors` paths are resolved against the file."""
    path = Path(path)
    edits = parse_edits(read_structured(path), str(path))
    for edit in edits:
        if isinstance(edit, Inject) and edit.vectors is not None:
            edit.vectors = str((path.parent / edit.vectors).resolve())
    return edits
