"""The resolved recipe as YAML, each value commented with where it came from
(`python -m megatron_stem.train --recipe R --print-config`).

    model:
      hidden_size: 2048              # recipes/dense_1b.yaml
      seq_length: 32768              # recipes/dense_1b_long.yaml
    train:
      micro_batch_size: 2            # override
      deterministic: false           # default

A value's origin is the last recipe file of the `inherit:` chain that sets it, an
`override` from the command line, the data recipe that `data.blend` names (for
`data.sources`), or `default`. The text is the recipe: loaded back it is the same recipe,
with no `inherit:` left to follow.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

import yaml

from megatron_stem.config.recipe_files import DEFAULT, RecipeSource, origin_of
from megatron_stem.config.schema import Recipe
from megatron_stem.config.strict import to_dict

# Comments start at this column at most: a longer line puts its comment two spaces after.
_COMMENT_COLUMN = 44


def render(recipe: Recipe, source: RecipeSource) -> str:
    """`recipe` (loaded from `source`) as commented YAML."""
    origins = source.origins()
    if recipe.data.blend and "data.sources" not in origins:  # read from the data recipe
        origins["data.sources"] = recipe.data.blend
    rows: list[tuple[str, str | None]] = []
    _rows(to_dict(recipe), "", "", origins, rows)
    width = min(_COMMENT_COLUMN, max(len(text) for text, origin in rows if origin))
    body = [text if origin is None else f"{text:<{width}}  # {origin}" for text, origin in rows]
    return "\n".join(_header(source) + body) + "\n"


def shown(path: str | Path) -> str:
    """A path relative to the working directory when it is inside it, as recipes name
    files; else as it is."""
    relative = os.path.relpath(path)
    return str(path) if relative.startswith("..") else relative


def _header(source: RecipeSource) -> list[str]:
    chain = [shown(path) for path, _ in reversed(source.layers)]
    lines = [f"# {chain[0]}, resolved"]
    if len(chain) > 1:
        lines.append(f"# inherits: {' <- '.join(chain[1:])}")
    if source.overrides:
        lines.append(f"# overrides: {shlex.join(source.overrides)}")
    return lines


def _rows(mapping: dict, prefix: str, indent: str, origins: dict[str, str],
          rows: list) -> None:
    for key, value in mapping.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            rows.append((f"{indent}{key}:", None))
            _rows(value, dotted + ".", indent + "  ", origins, rows)
        elif isinstance(value, list) and any(isinstance(item, dict) for item in value):
            rows.append((f"{indent}{key}:", _origin(origins, dotted)))
            rows += [(f"{indent}  - {_flow(item)}", None) for item in value]
        else:
            rows.append((f"{indent}{key}: {_flow(value)}", _origin(origins, dotted)))


def _origin(origins: dict[str, str], key: str) -> str:
    origin = origin_of(origins, key)
    if origin is None:
        return DEFAULT
    return shown(origin) if os.path.isabs(origin) else origin


def _flow(value: Any) -> str:
    """`value` as one line of YAML (a string quoted where YAML would misread it)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=float("inf"), sort_keys=False)
    return text.removesuffix("\n").removesuffix("\n...")
