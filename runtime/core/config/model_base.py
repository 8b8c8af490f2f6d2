"""DeepSpeed's config-model base and config helpers (deepspeed.runtime.config_utils, compat/paths.py).

dslaunch's own config is typed dataclasses read by the strict parser (strict.py); this module is
for code written against DeepSpeed that defines *its own* config models on DeepSpeedConfigModel
(inference servers, plugins) and for the small helpers such code calls. It needs pydantic, as
DeepSpeed's base is a pydantic model; pydantic is not a dependency of dslaunch, so importing this
module without it is one ImportError line.

DeepSpeedConfigModel adds to pydantic: unknown keys refused, fields settable by name or alias,
assignments validated, enums stored as their values, a `dtype` field dumped as its name, "auto"
values dropped unless built with strict=True (Hugging Face passes "auto" for values it fills in
later), and deprecated fields: a field whose json_schema_extra says {"deprecated": True} logs a
warning when given and, with "new_param" (a field name, or a dotted path into a sub-model),
moves its value there through "new_param_fn" unless "set_new_param" is False; giving both the
deprecated field and its replacement is an AssertionError. One difference from DeepSpeed 0.19.8,
on purpose: new_param_fn runs only on a value that was given (DeepSpeed also runs it on the
default, so a function that cannot take the default fails every build).
"""
from __future__ import annotations

import collections.abc
import json
import logging
from functools import reduce

try:
    from pydantic import BaseModel, ConfigDict, field_serializer
except ImportError:  # pragma: no cover - the test environment has pydantic
    raise ImportError("deepspeed.runtime.config_utils needs pydantic (pip install pydantic): DeepSpeedConfigModel "
                      "is a pydantic model") from None

from ..strict import _repeated

logger = logging.getLogger("dslaunch.runtime")

# the key whose "auto" is a real value (the inference injection policy's replace_method)
_AUTO_KEPT = "replace_method"


class DeepSpeedConfigModel(BaseModel):
    """Base of config models written against DeepSpeed (see the module's docstring)."""

    model_config = ConfigDict(validate_default=True, validate_assignment=True, use_enum_values=True,
                              populate_by_name=True, extra="forbid", arbitrary_types_allowed=True,
                              protected_namespaces=())

    def __init__(self, strict: bool = False, **data):
        if not strict:
            data = {k: v for k, v in data.items() if k == _AUTO_KEPT or not (isinstance(v, str) and v == "auto")}
        super().__init__(**data)
        for name, info in type(self).model_fields.items():
            extra = info.json_schema_extra
            if isinstance(extra, dict) and extra.get("deprecated", False) and name in self.model_fields_set:
                self._move_deprecated(name, extra)

    def _move_deprecated(self, name: str, extra: dict) -> None:
        new_path = extra.get("new_param", "")
        note = extra.get("deprecated_msg", "")
        logger.warning("config key %s is deprecated%s%s", name, f"; use {new_path}" if new_path else "",
                       f" ({note})" if note else "")
        if not new_path or not extra.get("set_new_param", True):
            return
        value = extra.get("new_param_fn", lambda v: v)(getattr(self, name))
        # the deprecated field is gone once moved (reading it is an AttributeError, the dump omits it)
        delattr(self, name)
        *parents, leaf = new_path.split(".")
        owner = reduce(getattr, parents, self)
        if leaf in owner.model_fields_set:
            raise AssertionError(f"config keys {name} (deprecated) and {new_path} are both given: give only "
                                 f"{new_path}")
        setattr(owner, leaf, value)  # validated: the model validates assignments

    @field_serializer("dtype", check_fields=False)
    def _dtype_by_name(dtype) -> str:
        return str(dtype)


def get_config_default(config, field_name: str):
    """The default of `field_name` in a model (class or instance); an AssertionError when the
    model has no such field or the field is required."""
    cls = config if isinstance(config, type) else type(config)
    info = cls.model_fields.get(field_name)
    if info is None:
        raise AssertionError(f"{cls.__name__} has no field {field_name!r}")
    if info.is_required():
        raise AssertionError(f"{cls.__name__}.{field_name} is required: it has no default")
    return info.get_default(call_default_factory=True)


class pp_int(int):  # noqa: N801  DeepSpeed's name
    """An int shown with thousands separators, or as the label given (generated docs print these)."""

    def __new__(cls, val, custom_print_str=None):
        obj = super().__new__(cls, val)
        obj.custom_print_str = custom_print_str
        return obj

    def __repr__(self) -> str:
        return self.custom_print_str or f"{int(self):,}"

    __str__ = __repr__


class ScientificNotationEncoder(json.JSONEncoder):
    """json.dumps(..., cls=ScientificNotationEncoder): numbers above 1000 in scientific notation
    (`2.000000e+03`), one key per line. It keeps DeepSpeed's layout exactly: sort_keys is not
    applied, and a mapping inside a list is laid out from the left margin."""

    def iterencode(self, o, _one_shot=False, level=0):
        return self._text(o, level)

    def _text(self, o, level: int) -> str:
        step = " " * (self.indent if self.indent is not None else 4)
        if isinstance(o, bool):
            return "true" if o else "false"
        if isinstance(o, (int, float)):
            return format(o, "e") if o > 1e3 else f"{o}"
        if isinstance(o, collections.abc.Mapping):
            inner = step * (level + 1)
            items = [f'\n{inner}"{k}": {self._text(v, level + 1)}' for k, v in o.items()]
            return "{" + ", ".join(items) + f"\n{step * level}" + "}"
        if isinstance(o, collections.abc.Sequence) and not isinstance(o, str):
            return "[" + ", ".join(self._text(item, 0) for item in o) + "]"
        return "".join(super().iterencode(o))  # strings, None: plain JSON


class DeepSpeedConfigObject:
    """A config section object whose repr is its attributes as ScientificNotationEncoder JSON."""

    def repr(self):
        return self.__dict__

    def __repr__(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True, indent=4, cls=ScientificNotationEncoder)


def get_scalar_param(param_dict, param_name, param_default_value):
    return param_dict.get(param_name, param_default_value)


def get_list_param(param_dict, param_name, param_default_value):
    return param_dict.get(param_name, param_default_value)


def get_dict_param(param_dict, param_name, param_default_value):
    return param_dict.get(param_name, param_default_value)


def dict_raise_error_on_duplicate_keys(ordered_pairs):
    """json's object_pairs_hook that refuses a key given twice in one object (ValueError)."""
    repeated = _repeated(ordered_pairs)
    if repeated:
        raise ValueError(f"the config gives these keys more than once: {repeated}; keep one of each")
    return dict(ordered_pairs)


__all__ = ["DeepSpeedConfigModel", "get_config_default", "pp_int", "ScientificNotationEncoder",
           "DeepSpeedConfigObject", "get_scalar_param", "get_list_param", "get_dict_param",
           "dict_raise_error_on_duplicate_keys"]
