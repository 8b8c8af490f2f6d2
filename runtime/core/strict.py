"""Strict parsing of plain dicts (from JSON/YAML) into typed dataclasses.

One mechanism for the whole config: each section is a dataclass whose annotations are the
schema. An unknown key is an error naming its dotted path and the nearest valid key; a
value of the wrong type names the key, the value and the type expected. DeepSpeed
silently ignores misspelt keys, which turns a typo like "stgae" into a silent stage-0 run;
refusing them is the point of this module.

Supported annotations: bool, int, float, str, Any, Optional[X], List[X], Dict[str, Any],
Literal[...], nested dataclasses, and Union[bool, SomeDataclass] (for legacy boolean forms,
resolved by the dataclass's `from_bool` classmethod).

Every key DeepSpeed documents is declared, once, as a field of its section's dataclass:
`supported(default, note)` when it does here what DeepSpeed documents, `refused(reason,
*accepted)` when it does not. A refused key is accepted only at the values in `accepted`
(DeepSpeed's "off" value, which asks for nothing); any other value is an error whose text
is the reason. So nothing is silently ignored, and a documented key is never reported as
a typo. `key_rows(cls)` walks the declarations for the key table (docs/configuration.md). The value "auto"
(Hugging Face's placeholder) is refused everywhere with a line naming the key.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import sys
import typing
from dataclasses import MISSING, dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from dslaunch.launcher.errors import OneLineMessage


class ConfigError(OneLineMessage, ValueError):
    """A config problem, already phrased as the one line the user should see."""


META = "dslaunch.key"
INT64 = 1 << 63


@dataclass(frozen=True)
class KeyInfo:
    """What a declared key does here; attached to its dataclass field."""

    note: str = ""  # supported: one line on what it does (the key table)
    infinite: bool = False  # a float key that takes Infinity (every other refuses it, and NaN always)
    refused: Optional[str] = None  # why it is not supported here; the error line after "key: "
    accepted: Tuple[Any, ...] = ()  # values of a refused key that ask for nothing (or predicates)


def supported(default: Any = MISSING, note: str = "", *, factory: Any = MISSING, infinite: bool = False):
    """A key that does what DeepSpeed documents. `note` says how, for the key table;
    `infinite`: a float key that means something by Infinity ("never")."""
    meta = {META: KeyInfo(note=note, infinite=infinite)}
    if factory is not MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def refused(reason: str, *accepted: Any):
    """A documented key that is not supported here. Values in `accepted` (DeepSpeed's off
    value; a callable is a predicate) load and do nothing; anything else is refused with
    `reason`. The field's default is the first accepted value."""
    default = accepted[0] if accepted and not callable(accepted[0]) else None
    return dataclasses.field(default=default, metadata={META: KeyInfo(refused=reason, accepted=accepted)})


def disabled(value) -> bool:
    """The off form of a whole section: absent/empty, false, or {"enabled": false, ...}."""
    if value is None or value is False or value == {}:
        return True
    return isinstance(value, dict) and value.get("enabled") is False


def key_info(f: dataclasses.Field) -> KeyInfo:
    return f.metadata.get(META, KeyInfo())


def _same(value, ref) -> bool:
    if callable(ref):
        return bool(ref(value))
    if isinstance(value, bool) or isinstance(ref, bool):
        return isinstance(value, bool) and isinstance(ref, bool) and value == ref
    return value == ref


def _shown(value) -> str:
    return json.dumps(value) if _jsonable(value) else repr(value)


AUTO = "auto"


def auto_error(path: str) -> ConfigError:
    return ConfigError(f"{path}: \"auto\" is a placeholder the caller must resolve (the Hugging Face Trainer and "
                       f"Accelerate fill it in before calling initialize); write the actual value")


def find_auto(value, path: str) -> None:
    """Raise auto_error for the first "auto" inside a free-form value (optimizer params...)."""
    if isinstance(value, str) and value == AUTO:
        raise auto_error(path)
    if isinstance(value, dict):
        for k, v in value.items():
            find_auto(v, f"{path}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            find_auto(v, f"{path}[{i}]")


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
    return ConfigError(f"{path}: expected {_type_name(tp)}, got {_shown(value)}")


def _jsonable(value) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def convert(value, tp, path: str, infinite: bool = False):
    """Convert `value` to annotation `tp`, raising ConfigError naming `path`. A float is
    finite unless `infinite` (NaN is refused everywhere: it would poison what it touches)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        find_auto(value, path)
        return value
    if isinstance(value, str) and value == AUTO and not _admits(tp, AUTO):
        raise auto_error(path)
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
            return convert(value, candidates[0], path, infinite)
        for arg in candidates:
            try:
                return convert(value, arg, path, infinite)
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
        # DeepSpeed takes 0 and 1 for a switch (pydantic's bool, or a key read by truthiness);
        # any other number or a string is more likely a slip than a switch
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise _fail(path, value, tp)
    if tp is int:
        # JSON configs write 5e8 for bucket sizes: an integral float is an int.
        if isinstance(value, bool):
            raise _fail(path, value, tp)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int):
            raise _fail(path, value, tp)
        if not -INT64 <= value < INT64:  # every count and size ends up in a C int64
            raise ConfigError(f"{path}: {value} is out of range (a 64-bit integer)")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _fail(path, value, tp)
        try:
            number = float(value)
        except OverflowError:
            raise ConfigError(f"{path}: {value} is out of range") from None
        if math.isnan(number) or (math.isinf(number) and not infinite):
            raise ConfigError(f"{path}: must be finite, got {_shown(value)}")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise _fail(path, value, tp)
    raise TypeError(f"unsupported annotation {tp!r} at {path}")


def _admits(tp, value) -> bool:
    """Whether annotation `tp` takes this string as a legitimate value."""
    if tp is str or tp is Any:
        return False  # a free-form string field never legitimately holds "auto" in a DeepSpeed config
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return value in typing.get_args(tp)
    if origin is typing.Union:
        return any(_admits(a, value) for a in typing.get_args(tp))
    return False


def parse_dataclass(cls, data: Dict[str, Any], path: str = ""):
    """Build `cls` from `data`; every key must be a field (or a declared alias), and a
    refused key must hold one of its accepted values."""
    hints = typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    aliases: Dict[str, str] = getattr(cls, "ALIASES", {})
    kwargs = {}
    for key, value in data.items():
        name = aliases.get(key, key)
        where = f"{path}.{key}" if path else key
        if name not in fields:
            # a section may say where such a key belongs (UNKNOWN_KEY_HINT, formatted with it)
            hint = suggest(key, list(fields) + list(aliases)) or getattr(cls, "UNKNOWN_KEY_HINT", "").format(
                path=path, key=key)
            raise ConfigError(f"{where}: unknown key{hint}")
        info = key_info(fields[name])
        if info.refused is not None:
            if not any(_same(value, ok) for ok in info.accepted):
                raise auto_error(where) if isinstance(value, str) and value == AUTO else \
                    ConfigError(f"{where}: {info.refused}")
            kwargs[name] = value
            continue
        kwargs[name] = convert(value, hints[name], where, info.infinite)
    for name, f in fields.items():
        if name not in kwargs and f.default is MISSING and f.default_factory is MISSING:
            raise ConfigError(f"{path + '.' if path else ''}{name}: required")
    obj = cls(**kwargs)
    # outside the fields, so equality, asdict and the key table never see it
    object.__setattr__(obj, "_given_keys", frozenset(kwargs))
    check = getattr(obj, "validate", None)
    if check is not None:
        check(path)
    return obj


def given(section, name: str) -> bool:
    """Whether the config text wrote field `name` of this parsed section (under any of its
    spellings), as opposed to its taking the default. For the few keys whose meaning depends
    on being asked for; False for a section built in code."""
    return name in getattr(section, "_given_keys", ())


@dataclass(frozen=True)
class KeyRow:
    """One line of the key table: dotted key, "supported" / "refused[ unless X]" / "section"
    (a group of keys, listed below it), and the note (what it does here, or why refused)."""

    key: str
    status: str
    note: str


def _sections(tp) -> List[type]:
    """The dataclasses an annotation nests (Optional[X], Union[bool, X], X)."""
    if dataclasses.is_dataclass(tp):
        return [tp]
    if typing.get_origin(tp) is typing.Union:
        return [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
    return []


def _accepted_text(accepted) -> str:
    shown = [_shown(a) for a in accepted if not callable(a)]
    if any(callable(a) for a in accepted):
        shown.append("disabled")
    return f" unless {' or '.join(shown)}" if shown else ""


def key_rows(cls, prefix: str = "") -> Iterator[KeyRow]:
    """Every declared key of `cls`, depth first, in declaration order."""
    hints = typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key = f"{prefix}{f.name}"
        info = key_info(f)
        if info.refused is not None:
            yield KeyRow(key, "refused" + _accepted_text(info.accepted), info.refused)
            continue
        sections = _sections(hints[f.name])
        yield KeyRow(key, "section" if sections and not info.note else "supported", info.note)
        for section in sections:
            yield from key_rows(section, key + ".")
    by_name = {f.name: key_info(f) for f in dataclasses.fields(cls)}
    for alias, target in getattr(cls, "ALIASES", {}).items():
        info = by_name[target]
        status = "supported" if info.refused is None else "refused" + _accepted_text(info.accepted)
        yield KeyRow(f"{prefix}{alias}", status, f"another spelling of {prefix}{target}")


def _line_col(text: str, pos: int) -> Tuple[int, int]:
    line = text.count("\n", 0, pos) + 1
    col = pos - (text.rfind("\n", 0, pos) + 1) + 1
    return line, col


# Objects and lists inside each other: a DeepSpeed config needs fewer than 10 levels. The bound
# keeps every recursive walk of a config (parsing, conversion, the "auto" search) well inside
# Python's recursion limit, so a crafted file is one line, not a RecursionError.
MAX_DEPTH = 64


def _too_deep(source: str) -> ConfigError:
    return ConfigError(f"{source}: objects and lists nested more than {MAX_DEPTH} deep; a DeepSpeed config "
                       "needs only a few levels")


def check_depth(data, source: str) -> None:
    """Refuse a value nested deeper than MAX_DEPTH (iteratively: the check itself never recurses)."""
    todo = [(data, 1)]
    while todo:
        node, depth = todo.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, (list, tuple)):
            children = node
        else:
            continue
        if depth > MAX_DEPTH:
            raise _too_deep(source)
        todo.extend((c, depth + 1) for c in children)


def _repeated(pairs) -> List[str]:
    seen: set = set()
    out: List[str] = []
    for k, _ in pairs:
        if k in seen and k not in out:
            out.append(k)
        seen.add(k)
    return out


def _path_to(root, target) -> str:
    """The dotted path of the object `target` (by identity) inside `root`."""
    todo = [(root, "")]
    while todo:
        node, path = todo.pop()
        if node is target:
            return path
        if isinstance(node, dict):
            todo.extend((v, f"{path}.{k}" if path else str(k)) for k, v in node.items())
        elif isinstance(node, list):
            todo.extend((v, f"{path}[{i}]") for i, v in enumerate(node))
    return ""


def _load_json(text: str, source: str):
    """json.loads that refuses duplicate keys (as DeepSpeed does: its reader raises on them)
    instead of keeping the last one silently."""
    duplicates: List[Tuple[dict, List[str], int]] = []

    def object_of(pairs):
        obj = dict(pairs)
        if len(obj) != len(pairs):
            keys = _repeated(pairs)
            duplicates.append((obj, keys, sum(1 for k, _ in pairs if k == keys[0])))
        return obj

    try:
        data = json.loads(text, object_pairs_hook=object_of)
    except json.JSONDecodeError as exc:
        line, col = _line_col(text, exc.pos)
        raise ConfigError(f"{source}:{line}:{col}: invalid JSON: {exc.msg}") from None
    except RecursionError:
        raise _too_deep(source) from None
    if duplicates:
        obj, keys, times = duplicates[0]
        inside = _path_to(data, obj)
        where = f"{inside}.{keys[0]}" if inside else keys[0]
        others = f" (and {', '.join(keys[1:])})" if len(keys) > 1 else ""
        count = "twice" if times == 2 else f"{times} times"
        raise ConfigError(f"{source}: {where}: the key is given {count}{others}; DeepSpeed refuses "
                          "duplicate keys too: keep one")
    return data


def _load_yaml(text: str, source: str):
    import yaml

    class Loader(yaml.SafeLoader):
        """safe_load, less what a config never needs and a crafted file abuses: an alias (one
        node used many times over: a few lines can stand for billions of values) and a key
        given twice (safe_load keeps the last silently)."""

        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                raise yaml.composer.ComposerError(None, None, "anchors and aliases are not supported in a config; "
                                                  "write the values out", self.peek_event().start_mark)
            return super().compose_node(parent, index)

        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                try:
                    again = key in seen
                except TypeError:  # an unhashable key: construct_mapping names it
                    break
                if again:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"the key {key!r} is given twice; keep one", key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep)

    try:
        return yaml.load(text, Loader=Loader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        raise ConfigError(f"{where}: invalid YAML: {getattr(exc, 'problem', exc)}") from None
    except RecursionError:
        raise _too_deep(source) from None


def load_text(text: str, source: str) -> Dict[str, Any]:
    """Parse JSON (or YAML when the source says so) text into a dict, with line:column errors;
    duplicate keys and nesting deeper than MAX_DEPTH are refused."""
    data = _load_yaml(text, source) if source.endswith((".yaml", ".yml")) else _load_json(text, source)
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the config must be a JSON object, got {type(data).__name__}")
    check_depth(data, source)
    return data


CONFIG_FILE_LIMIT = 64 << 20  # DeepSpeed configs are kilobytes; a bound keeps /dev/zero from filling memory


def load_file(path: str) -> Dict[str, Any]:
    from dslaunch.launcher.bounded_read import read_bounded  # regular files only, at most the limit

    try:
        raw = read_bounded(path, CONFIG_FILE_LIMIT, "config file", ConfigError)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: config is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return load_text(text, path)


def to_dict(obj) -> Optional[Dict[str, Any]]:
    return dataclasses.asdict(obj) if obj is not None else None
