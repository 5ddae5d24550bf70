"""Typed configuration from YAML plus dotted command-line overrides.

Every component owns a small dataclass for its own section; this module turns
plain mappings into those dataclasses, checking keys and types, and reports
every problem with the key path, the file it came from and a fix (the closest
valid key for a typo). Nothing here knows about any particular section.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Mapping

import yaml


class ConfigError(ValueError):
    """A configuration that cannot run. The message names key, source and fix."""


def require_power_of_two(name: str, value: int) -> None:
    """Refuse ``value`` of the key ``name`` unless it is a power of two >= 1 (a TP or EP size)."""
    if value < 1 or value & (value - 1):
        raise ConfigError(f"{name} must be a power of two >= 1, got {value}")


def load_yaml(path: str | Path, _within: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The file's sections; a top-level ``base: other.yaml`` (beside it) is read first and this
    file's keys replace its keys, section by section (a list is replaced whole)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist"
                          + (f" (the base of {_within[-1]})" if _within else ""))
    if path.resolve() in _within:
        raise ConfigError(f"{path}: its base chain comes back to it: {' -> '.join(map(str, _within))} -> {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base must be a file name (relative to {path.parent}), got {base!r}")
    return _merged(load_yaml(path.parent / base, (*_within, path.resolve())), data)


def _merged(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        out[key] = _merged(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), dict) else value
    return out


def apply_overrides(data: dict[str, Any], overrides: list[str], source: str = "command line") -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides; the value is parsed as YAML (numbers, lists, bools)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{source}: override {item!r} must look like section.key=value")
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{source}: {key!r}: {part!r} is a value, not a section")
            node = child
        node[parts[-1]] = yaml.safe_load(raw) if raw != "" else ""
    return data


def build(cls: type, data: Mapping[str, Any] | None, *, where: str, source: str) -> Any:
    """Build dataclass ``cls`` from ``data``, refusing unknown keys and wrong types.

    ``where`` is the dotted key path of this section; ``source`` the file.
    After construction the dataclass's own ``validate()`` runs, if it has one.
    """
    data = {} if data is None else data
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: {where} must be a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    for key in data:
        if key not in fields:
            raise ConfigError(_unknown_key(f"{where}.{key}" if where else key, key, fields, source))
    kwargs = {}
    for name, value in data.items():
        path = f"{where}.{name}" if where else name
        kwargs[name] = _coerce(hints[name], value, path, source)
    try:
        obj = cls(**kwargs)
    except TypeError as exc:  # a required field is missing
        raise ConfigError(f"{source}: section {where or '<root>'}: {exc}") from None
    validate = getattr(obj, "validate", None)
    if validate is not None:
        try:
            validate()
        except ConfigError as exc:
            raise ConfigError(f"{source}: {where}.{exc}" if where else f"{source}: {exc}") from None
    return obj


def to_dict(obj: Any) -> Any:
    return dataclasses.asdict(obj)


def _unknown_key(path: str, key: str, fields: Mapping[str, Any], source: str) -> str:
    close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.5)
    parent = path.rsplit(".", 1)[0] + "." if "." in path else ""
    hint = f"did you mean '{parent}{close[0]}'?" if close else f"valid keys: {', '.join(sorted(fields))}"
    return f"{source}: unknown key {path!r}; {hint}"


def _coerce(tp: Any, value: Any, path: str, source: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, where=path, source=source)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value, path, source)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0])
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{source}: {path} must be one of {list(args)}, got {value!r}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{source}: {path} must be a list, got {type(value).__name__} {value!r}")
        elem = args[0] if args else Any
        items = [_coerce(elem, v, f"{path}[{i}]", source) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{source}: {path} must be a mapping, got {type(value).__name__}")
        return dict(value)
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads 3e-5 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if tp in (int, float) and isinstance(value, bool):
        raise ConfigError(f"{source}: {path} must be {tp.__name__}, got bool {value!r}")
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{source}: {path} must be {tp.__name__}, got {type(value).__name__} {value!r}")
    return value
