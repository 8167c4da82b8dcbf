"""The strict loader: a dataclass built from a mapping, every field checked.

Every field is type-checked on load, unknown keys are errors (with a suggestion), numbers
must be finite and within the range their dataclass declares (`RANGES`: `Range`), and each
dataclass's `validate()` checks cross-field rules. All errors are `ConfigError`s whose
message starts with the dotted path of the offending field.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from megatron_stem.runtime.errors import ConfigError


def from_dict(cls: type, data: Any, where: str = ""):
    """Build dataclass `cls` from a mapping, checking names and types recursively; the
    first problem found is raised (`collect` finds them all)."""
    obj, problems = collect(cls, data, where)
    if problems:
        raise ConfigError(problems[0])
    return obj


def collect(cls: type, data: Any, where: str = "") -> tuple[Any, list[str]]:
    """(`cls` built from `data`, every problem found on the way, one line each). A field
    with a problem keeps its default, and the cross-field rules (`validate()`) are checked
    only in a part whose fields are all valid, so no problem follows from another; the
    object is None when a required part could not be built."""
    problems: list[str] = []
    try:
        return _build(cls, data, where, problems), problems
    except _Unbuilt:
        return None, problems


class _Unbuilt(Exception):
    """A part that could not become its dataclass; its problems are listed already."""


def _build(cls: type, data: Any, where: str, problems: list[str]):
    label = where.rstrip(".") or "recipe"
    if not isinstance(data, dict):
        problems.append(f"{label}: expected a mapping, got {type(data).__name__}")
        raise _Unbuilt
    before = len(problems)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    moved = getattr(cls, "MOVED", {})
    for key in data:
        if key in moved:
            problems.append(f"{where}{key}: moved to {moved[key]}")
        elif key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            problems.append(f"{where}{key}: unknown field{hint}")
    hints = typing.get_type_hints(cls)
    kwargs, unbuilt = {}, False
    for name, f in fields.items():
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if name in data:
            try:
                kwargs[name] = _coerce(data[name], hints[name], f"{where}{name}", problems)
            except ConfigError as e:
                problems.append(str(e))
            except _Unbuilt:
                pass
        elif required:
            problems.append(f"{where}{name}: required field is missing")
        unbuilt |= required and name not in kwargs
    if unbuilt:
        raise _Unbuilt
    obj = cls(**kwargs)
    for name, allowed in getattr(cls, "RANGES", {}).items():
        try:
            allowed.check(getattr(obj, name), f"{where}{name}")
        except ConfigError as e:
            problems.append(str(e))
    validate = getattr(obj, "validate", None)
    if validate is not None and len(problems) == before:
        try:
            validate()
        except ConfigError as e:
            problems.append(f"{where}{e}")
    return obj


@dataclass(frozen=True)
class Range:
    """The values a numeric field may take, declared per dataclass in `RANGES`
    ({field: Range}) and checked at load: `low` <= value (< `low` is refused; with
    `above`, value must exceed it), value <= `high`. `why` ends the error of a value above
    `high` (what the bound guards against)."""

    low: Optional[float] = None
    high: Optional[float] = None
    above: Optional[float] = None
    why: str = ""

    def check(self, value, where: str) -> None:
        if value is None:
            return
        if self.above is not None and not value > self.above:
            raise ConfigError(f"{where}: must be above {_bound(self.above)}, got {value!r}")
        if self.low is not None and value < self.low:
            raise ConfigError(f"{where}: must be >= {_bound(self.low)}, got {value!r}")
        if self.high is not None and value > self.high:
            why = f" ({self.why})" if self.why else ""
            raise ConfigError(f"{where}: must be <= {_bound(self.high)}, got {value!r}{why}")


def _bound(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _coerce(value: Any, typ: Any, where: str, problems: list[str]):
    """`value` as type `typ`, or a ConfigError; a dataclass's problems go to `problems`."""
    origin = typing.get_origin(typ)
    if dataclasses.is_dataclass(typ):
        return _build(typ, value, where + ".", problems)
    if origin in (Union, types.UnionType):
        options = typing.get_args(typ)
        if value is None and type(None) in options:
            return None
        if len(options) == 2 and type(None) in options:  # Optional: its type's own message
            (option,) = [o for o in options if o is not type(None)]
            return _coerce(value, option, where, problems)
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, where, problems)
            except ConfigError as e:
                errors.append(str(e).split(": ", 1)[-1])
        raise ConfigError(f"{where}: {' or '.join(errors)}")
    if origin is Literal:
        choices = typing.get_args(typ)
        if all(type(c) is int for c in choices) and isinstance(value, (str, float)):
            value = _number(value, int, where)  # `zero_stage: "2"` as for an int field
        if value not in choices:
            raise ConfigError(f"{where}: expected one of {list(choices)}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (item,) = typing.get_args(typ)
        return [_coerce(v, item, f"{where}[{i}]", problems) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        _, item = typing.get_args(typ)
        return {k: _coerce(v, item, f"{where}.{k}", problems) for k, v in value.items()}
    if typ is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        return value
    if typ in (int, float):
        return _number(value, typ, where)
    if typ is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    if typ is Any:
        return value
    raise TypeError(f"unsupported config type {typ!r} at {where}")  # a bug in a dataclass


def _number(value: Any, typ: type, where: str):
    """A numeric field's value as people type it: whatever Python's `float()` (or `int()`)
    reads, as a number or a string (YAML 1.1 reads `3e-4` and `1e5` as strings; so does an
    override), and for an int field also a float that is integral (`1e5`, `2.0`). A bool
    is never a number."""
    number = value
    if isinstance(value, str):
        for parse in ((int, float) if typ is int else (float,)):
            try:
                number = parse(value)
                break
            except ValueError:
                continue
    if not isinstance(number, bool):
        if typ is float and isinstance(number, (int, float)):
            if not math.isfinite(number):  # .nan, .inf: no setting means either
                raise ConfigError(f"{where}: expected a finite number, got {value!r}")
            return float(number)
        if typ is int and isinstance(number, int):
            return number
        if typ is int and isinstance(number, float) and number.is_integer():
            return int(number)
    kind = "an integer" if typ is int else "a number"
    raise ConfigError(f"{where}: expected {kind}, got {value!r}")


def to_dict(obj) -> dict:
    return dataclasses.asdict(obj)


def read_mapping(path: Path, what: str) -> dict:
    """A YAML file's top-level mapping (a recipe's sections, a data recipe's fields)."""
    if not path.is_file():
        raise ConfigError(f"{path}: {what} file not found")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a {what} must be a YAML mapping")
    return data
