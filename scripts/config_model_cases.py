"""What deepspeed.runtime.config_utils does, case by case: the cases that
scripts/make_ds_config_model_fixtures.py runs through DeepSpeed 0.19.8 (tests/data/ds_config_model.json)
and tests/runtime/core/test_config_model_base.py replays on dslaunch's module.

`run_all(mod)` takes the config_utils module under test (DeepSpeed's or ours) and returns a
JSON-able record {case name: outcome}; an outcome is either the values the case produced or
{"error": exception type name}. The config models are built here on `mod.DeepSpeedConfigModel`
so both sides define the very same classes.
"""
import enum
import json
from typing import List, Optional

import torch
from pydantic import Field


def _models(base):
    """The config models every case builds, as DeepSpeed's users define them."""

    class Simple(base):
        param_1: int = 0
        param_2_old: Optional[str] = Field(None, json_schema_extra={"deprecated": True, "new_param": "param_2",
                                                                    "new_param_fn": (lambda x: [x])})
        param_2: Optional[List[str]] = None
        param_3: int = Field(0, alias="param_3_alias")

    class Inner(base):
        x: int = 1

    class Nested(base):
        sub: Inner = Field(default_factory=Inner)
        old_x: Optional[int] = Field(None, json_schema_extra={"deprecated": True, "new_param": "sub.x"})

    class KeepOld(base):
        old: int = Field(0, json_schema_extra={"deprecated": True, "deprecated_msg": "no replacement"})
        old_kept: int = Field(0, json_schema_extra={"deprecated": True, "new_param": "new",
                                                    "set_new_param": False})
        new: int = 7

    class BadFn(base):
        old: Optional[str] = Field(None, json_schema_extra={"deprecated": True, "new_param": "new",
                                                            "new_param_fn": (lambda x: x)})
        new: Optional[int] = None

    class Colour(enum.Enum):
        red = "red"
        blue = "blue"

    class Typed(base):
        colour: Colour = Colour.red
        dtype: torch.dtype = torch.float16
        replace_method: str = "auto"

    class Required(base):
        must: int
        may: int = 3

    return {"Simple": Simple, "Nested": Nested, "KeepOld": KeepOld, "BadFn": BadFn, "Typed": Typed,
            "Required": Required}


# name -> (model, keyword arguments, strict)
BUILDS = {
    "empty": ("Simple", {}, False),
    "param_1": ("Simple", {"param_1": 42}, False),
    "param_1_from_str": ("Simple", {"param_1": "5"}, False),
    "param_1_bad_str": ("Simple", {"param_1": "DS"}, False),
    "param_1_float": ("Simple", {"param_1": 2.5}, False),
    "param_2_str": ("Simple", {"param_2": "DS"}, False),
    "typo": ("Simple", {"param_1_typo": 0}, False),
    "deprecated_to_new": ("Simple", {"param_2_old": "DS"}, False),
    "deprecated_and_new": ("Simple", {"param_2": ["DS"], "param_2_old": "DS"}, False),
    "by_name": ("Simple", {"param_3": 10}, False),
    "by_alias": ("Simple", {"param_3_alias": 10}, False),
    "auto_dropped": ("Simple", {"param_1": "auto", "param_3": 4}, False),
    "auto_strict": ("Simple", {"param_1": "auto"}, True),
    "nested_deprecated": ("Nested", {"old_x": 5}, False),
    "nested_deprecated_and_new": ("Nested", {"old_x": 5, "sub": {"x": 2}}, False),
    "nested_sub_only": ("Nested", {"sub": {"x": 2}}, False),
    "nested_sub_typo": ("Nested", {"sub": {"y": 2}}, False),
    "deprecated_no_new": ("KeepOld", {"old": 3}, False),
    "deprecated_not_moved": ("KeepOld", {"old_kept": 4}, False),
    "deprecated_bad_value_for_new": ("BadFn", {"old": "many"}, False),
    "deprecated_good_value_for_new": ("BadFn", {"old": "12"}, False),
    "typed_defaults": ("Typed", {}, False),
    "typed_enum_value": ("Typed", {"colour": "blue"}, False),
    "typed_enum_bad": ("Typed", {"colour": "green"}, False),
    "typed_dtype": ("Typed", {"dtype": torch.bfloat16}, False),
    "typed_replace_method_auto": ("Typed", {"replace_method": "auto"}, False),
    "typed_replace_method_other": ("Typed", {"replace_method": "layer"}, False),
    "required_missing": ("Required", {}, False),
    "required_given": ("Required", {"must": 1}, False),
}


def _jsonable(value):
    if isinstance(value, enum.Enum):
        return {"enum": value.value}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value)}
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "model_fields_set"):  # a sub-model
        return _state(value)
    return value


def _state(config) -> dict:
    """What a script can see of a built model: each field's value (or that reading it fails),
    the fields it was given, and its dump."""
    values = {}
    for name in type(config).model_fields:
        try:
            values[name] = _jsonable(getattr(config, name))
        except Exception as exc:  # noqa: BLE001  the failure is the record
            values[name] = {"error": type(exc).__name__}
    try:
        dump = _jsonable(config.model_dump())
    except Exception as exc:  # noqa: BLE001
        dump = {"error": type(exc).__name__}
    return {"values": values, "fields_set": sorted(config.model_fields_set), "dump": dump}


def _outcome(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001  the exception's type is the record
        return {"error": type(exc).__name__}


def _default(mod, models, model, field):
    return lambda: {"default": _jsonable(mod.get_config_default(models[model], field))}


def _dumps(mod, obj):
    return lambda: {"text": json.dumps(obj, cls=mod.ScientificNotationEncoder, indent=4)}


def _duplicates(mod, text):
    return lambda: {"parsed": json.loads(text, object_pairs_hook=mod.dict_raise_error_on_duplicate_keys)}


def run_all(mod) -> dict:
    models = _models(mod.DeepSpeedConfigModel)
    out = {}
    for name, (model, kwargs, strict) in BUILDS.items():
        cls = models[model]
        out[f"build.{name}"] = _outcome(lambda: _state(cls(strict=strict, **kwargs)))
    out["default.param_1"] = _outcome(_default(mod, models, "Simple", "param_1"))
    out["default.param_2"] = _outcome(_default(mod, models, "Simple", "param_2"))
    out["default.missing"] = _outcome(_default(mod, models, "Simple", "param_9"))
    out["default.required"] = _outcome(_default(mod, models, "Required", "must"))
    out["default.typed_dtype"] = _outcome(_default(mod, models, "Typed", "dtype"))
    for value, label in ((100000, None), (1234567, None), (5, "five"), (999, None), (0, "")):
        pp = mod.pp_int(value, label) if label is not None else mod.pp_int(value)
        out[f"pp_int.{value}.{label}"] = {"repr": repr(pp), "str": str(pp), "int": int(pp), "plus": pp + 1}
    objects = {
        "flat": {"a": 1, "b": 2000, "c": 1.5, "d": 12345.678, "e": True, "f": None, "g": "text"},
        "nested": {"outer": {"inner": {"n": 1e6, "m": [1, 2, 3000]}, "flag": False}, "list": [{"k": 1}, "s"]},
        "list": [1, 10000, [2, 3], "x"],
        "negative": {"small": -5000, "big": 5e9},
        "scalar_big": 123456,
        "scalar_bool": False,
        "empty": {},
    }
    for name, obj in objects.items():
        out[f"encoder.{name}"] = _outcome(_dumps(mod, obj))

    class Holder(mod.DeepSpeedConfigObject):
        def __init__(self):
            super().__init__()
            self.zeta = 3
            self.alpha = 50000
            self.nested = {"b": True, "a": [1, 2]}

    out["object.repr"] = {"repr": repr(Holder()), "dict": Holder().repr()}
    params = {"a": 1, "b": [1], "c": {"x": 1}}
    out["params"] = {"scalar": mod.get_scalar_param(params, "a", 9), "scalar_missing": mod.get_scalar_param(params, "z", 9),
                     "list": mod.get_list_param(params, "b", []), "list_missing": mod.get_list_param(params, "z", [0]),
                     "dict": mod.get_dict_param(params, "c", {}), "dict_missing": mod.get_dict_param(params, "z", {"d": 1})}
    for name, text in (("unique", '{"a": 1, "b": {"c": 2}}'), ("top", '{"a": 1, "a": 2}'),
                       ("inner", '{"a": {"c": 1, "c": 1}}'), ("two", '{"a": 1, "b": 1, "a": 1, "b": 2}')):
        out[f"duplicates.{name}"] = _outcome(_duplicates(mod, text))
    return out
