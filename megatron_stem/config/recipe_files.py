"""Reading a recipe: its `inherit:` chain, the command line's `section.field=value`
overrides over it, and which file or override each value came from (`RecipeSource`), so
that every problem is named by where it was written."""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from megatron_stem.config.schema import Recipe
from megatron_stem.config.strict import collect, read_mapping
from megatron_stem.runtime.errors import ConfigError


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b.c=value` overrides (value parsed as YAML) to a nested mapping in place."""
    for item in overrides:
        apply_override(data, item)
    return data


def apply_override(data: dict, item: str) -> None:
    """One `a.b.c=value` override: the value (parsed as YAML) replaces what `data` holds."""
    key, value = parse_override(item)
    node = data
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"command line: {item}: '{part}' is not a section")
    node[leaf] = value


def parse_override(item: str) -> tuple[str, Any]:
    """(dotted key, value) of an `a.b.c=value` override."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"command line: {item}: expected the form section.field=value")
    try:
        return key, yaml.safe_load(raw)
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"command line: {item}: not a YAML value ({problem})") from None


def _read_layers(path: Path, chain: tuple = ()) -> list[tuple[Path, dict]]:
    """A recipe file's mapping after those it inherits from (`inherit: other.yaml`,
    relative to the file), the furthest ancestor first."""
    if path in chain:
        raise ConfigError(f"{path}: inherit cycle through {' -> '.join(map(str, chain))}")
    data = read_mapping(path, "recipe")
    parent = data.pop("inherit", None)
    above = [] if parent is None else \
        _read_layers((path.parent / parent).resolve(), chain + (path,))
    return above + [(path, data)]


def _deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        out[key] = _deep_merge(out[key], value) \
            if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_recipe(path: str | Path, overrides: list[str] = (), cls: type = Recipe):
    """Read a YAML recipe (following `inherit:`), apply dotted overrides, validate; the
    first problem is raised, named by the file or override it came from."""
    recipe, problems = RecipeSource.read(path, overrides).load(cls)
    if problems:
        raise ConfigError(problems[0])
    return recipe


OVERRIDE = "override"  # the origin of a value given on the command line
DEFAULT = "default"  # the origin of a value no file nor override sets


@dataclass
class RecipeSource:
    """A recipe as written: its files (the `inherit:` chain, the furthest ancestor first)
    and the command-line overrides applied over them, in order. Knows which of them
    each value came from (`origins`) and blames each problem on one (`load`)."""

    path: Path
    layers: list[tuple[Path, dict]]
    overrides: list[str]

    @classmethod
    def read(cls, path: str | Path, overrides: list[str] = ()) -> "RecipeSource":
        path = Path(path).resolve()
        return cls(path, _read_layers(path), list(overrides))

    def mapping(self, overrides: int | None = None) -> tuple[dict, list[str]]:
        """(the merged mapping with the first `overrides` overrides applied (default all),
        the problems of overrides that could not be applied)."""
        data: dict = {}
        for _, layer in self.layers:
            data = _deep_merge(data, layer)
        data = copy.deepcopy(data)  # the overrides change it in place, never the layers
        problems = []
        for item in self.overrides[:overrides]:
            try:
                apply_override(data, item)
            except ConfigError as e:
                problems.append(str(e))
        return data, problems

    def load(self, cls: type = Recipe) -> tuple[Any, list[str]]:
        """(the recipe, or None if it could not be built; every problem, each naming the
        override or file it came from)."""
        data, problems = self.mapping()
        recipe, found = collect(cls, data)
        if not found:
            return recipe, problems
        found_with = functools.cache(lambda count: collect(cls, self.mapping(count)[0])[1])
        return recipe, problems + [self._blame(p, found_with) for p in found]

    def origins(self) -> dict[str, str]:
        """{dotted key: the file (absolute path) or `OVERRIDE` that set it}, for every
        value set; a key absent has its default."""
        out: dict[str, str] = {}
        for path, layer in self.layers:
            _note_origins(out, "", layer, str(path))
        for item in self.overrides:
            try:
                key, value = parse_override(item)
            except ConfigError:
                continue
            _drop_origins(out, key)  # an override replaces, even a whole section
            _note_origins(out, key, value, OVERRIDE)
        return out

    def _blame(self, problem: str, found_with) -> str:
        """`problem` ("field: what") prefixed by where the field's value came from: the last
        override that set it (or a section holding it); else the first override after which
        the problem appears (a rule across fields that it broke); else the recipe file
        (and the inherited file that set the field, when another)."""
        if problem.startswith("command line: "):
            return problem
        field, _, what = problem.partition(": ")
        for item in reversed(self.overrides):
            key = item.partition("=")[0]
            if field == key:
                return f"command line: {item}: {what}"
            if _within(field, key) or _within(key, field):
                return f"command line: {item}: {problem}"
        first = next((n for n in range(len(self.overrides) + 1) if problem in found_with(n)),
                     0)
        if first:
            return f"command line: {self.overrides[first - 1]}: {problem}"
        origin = origin_of(self.origins(), field)
        where = f" (set in {origin})" if origin not in (None, OVERRIDE, str(self.path)) else ""
        return f"{self.path}: {problem}{where}"


def origin_of(origins: dict[str, str], field: str) -> str | None:
    """Who set `field` (or the section holding it), of `RecipeSource.origins()`; None if
    nobody did."""
    key = field
    while key and key not in origins:
        key = _parent(key)
    return origins.get(key)


def _parent(key: str) -> str:
    """The section or list holding a dotted field (`a.b[0].c` -> `a.b[0]` -> `a.b`)."""
    cut = max(key.rfind("."), key.rfind("["))
    return key[:cut] if cut > 0 else ""


def _note_origins(out: dict, prefix: str, value: Any, origin: str) -> None:
    """Record `origin` for every leaf of `value` set at `prefix` (mappings merge, anything
    else replaces what was there)."""
    if isinstance(value, dict) and value:
        for key, item in value.items():
            _note_origins(out, f"{prefix}.{key}" if prefix else str(key), item, origin)
        return
    _drop_origins(out, prefix)
    out[prefix] = origin


def _drop_origins(out: dict, key: str) -> None:
    for known in [k for k in out if k == key or _within(k, key)]:
        del out[known]


def _within(field: str, section: str) -> bool:
    return field.startswith((section + ".", section + "["))
