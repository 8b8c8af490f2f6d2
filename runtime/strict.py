"""Strict parsing of plain dicts (from JSON/YAML) into typed dataclasses.

One mechanism for the whole config: each section is a dataclass whose annotations are the
schema. An unknown key is an error naming its dotted path and the nearest valid key; a
value of the wrong type names the key, the value and the type expected. DeepSpeed
silently ignores misspelt keys, which turns a typo like "stgae" into a silent stage-0 run;
refusing them is the point of this module.

Supported annotations: bool, int, float, str, Any, Optional[X], List[X], Dict[str, Any],
Literal[...], nested dataclasses, and Union[bool, SomeDataclass] (for legacy boolean forms,
resolved by the dataclass's `from_bool` classmethod).
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import sys
import typing
from typing import Any, Dict, Optional, Tuple


class ConfigError(ValueError):
    """A config problem, already phrased as the one line the user should see."""


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if tp is type(None):
        return "null"
    if origin is typing.Union:
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        return "list"
    if origin is dict:
        return "object"
    if dataclasses.is_dataclass(tp):
        return "object"
    return getattr(tp, "__name__", str(tp))


def suggest(key: str, valid) -> str:
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else ""


def _fail(path: str, value, tp) -> ConfigError:
    return ConfigError(f"{path}: expected {_type_name(tp)}, got {json.dumps(value) if _jsonable(value) else repr(value)}")


def _jsonable(value) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def convert(value, tp, path: str):
    """Convert `value` to annotation `tp`, raising ConfigError naming `path`."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is typing.Union:
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        # Union[bool, Dataclass]: the legacy boolean form of a section.
        if isinstance(value, bool) and bool in non_none:
            others = [a for a in non_none if dataclasses.is_dataclass(a)]
            if others and hasattr(others[0], "from_bool"):
                return others[0].from_bool(value)
            return value
        candidates = [a for a in non_none if a is not bool]
        if len(candidates) == 1:  # the only reading left: report its own, precise error
            return convert(value, candidates[0], path)
        for arg in candidates:
            try:
                return convert(value, arg, path)
            except ConfigError:
                pass
        raise _fail(path, value, tp)
    if origin is typing.Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            hint = suggest(str(value), [str(c) for c in choices]) if isinstance(value, str) else ""
            shown = json.dumps(value) if _jsonable(value) else repr(value)
            raise ConfigError(f"{path}: {shown} is not {_type_name(tp)}{hint}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise _fail(path, value, tp)
        args = typing.get_args(tp)
        item_tp = args[0] if args else Any
        return [convert(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _fail(path, value, tp)
        args = typing.get_args(tp)
        val_tp = args[1] if len(args) == 2 else Any
        return {str(k): convert(v, val_tp, f"{path}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise _fail(path, value, tp)
        return parse_dataclass(tp, value, path)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _fail(path, value, tp)
    if tp is int:
        # JSON configs write 5e8 for bucket sizes: an integral float is an int.
        if isinstance(value, bool):
            raise _fail(path, value, tp)
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise _fail(path, value, tp)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _fail(path, value, tp)
        return float(value)
    if tp is str:
        if isinstance(value, str):
            return value
        raise _fail(path, value, tp)
    raise TypeError(f"unsupported annotation {tp!r} at {path}")


def parse_dataclass(cls, data: Dict[str, Any], path: str = ""):
    """Build `cls` from `data`; every key must be a field (or a declared alias)."""
    hints = typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    aliases: Dict[str, str] = getattr(cls, "ALIASES", {})
    kwargs = {}
    for key, value in data.items():
        name = aliases.get(key, key)
        where = f"{path}.{key}" if path else key
        if name not in fields:
            raise ConfigError(f"{where}: unknown key{suggest(key, list(fields) + list(aliases))}")
        kwargs[name] = convert(value, hints[name], where)
    obj = cls(**kwargs)
    check = getattr(obj, "validate", None)
    if check is not None:
        check(path)
    return obj


def _line_col(text: str, pos: int) -> Tuple[int, int]:
    line = text.count("\n", 0, pos) + 1
    col = pos - (text.rfind("\n", 0, pos) + 1) + 1
    return line, col


def load_text(text: str, source: str) -> Dict[str, Any]:
    """Parse JSON (or YAML when the source says so) text into a dict, with line:column errors."""
    if source.endswith((".yaml", ".yml")):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
            raise ConfigError(f"{where}: invalid YAML: {getattr(exc, 'problem', exc)}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            line, col = _line_col(text, exc.pos)
            raise ConfigError(f"{source}:{line}:{col}: invalid JSON: {exc.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the config must be a JSON object, got {type(data).__name__}")
    return data


def load_file(path: str) -> Dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror}") from None
    return load_text(text, path)


def to_dict(obj) -> Optional[Dict[str, Any]]:
    return dataclasses.asdict(obj) if obj is not None else None
