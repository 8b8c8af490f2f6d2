"""Describe a set of dotted names in whichever Python runs this file (no project imports).

    echo '{"modules": ["deepspeed.comm"], "names": ["deepspeed.zero.Init"]}' | python scripts/api_probe.py

scripts/deepspeed_api_surface.py runs it twice, under real DeepSpeed's interpreter and under
ours with the compatibility package on the path, and compares the two answers; the test of
the committed table (tests/compat/test_deepspeed_api.py) runs it under ours. It prints JSON:

    {"modules": {MODULE: [public names defined in DeepSpeed's code] | {"error": "..."}},
     "names":   {NAME: {"found": bool, "kind": "function|class|module|value",
                        "params": [[name, kind, has_default], ...] | null, "error": "..."}}}

"Public names" of a module are its `__all__`, or else its attributes not starting with `_`
that are classes or functions whose `__module__` lies under the module's top package: what
DeepSpeed defines, not what it imports from torch or typing. `params` is the signature of a
function, or of a class's __init__ without `self`; null where there is none to read.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import json
import sys


def public_names(module_name: str):
    module = importlib.import_module(module_name)
    listed = getattr(module, "__all__", None)
    top = module_name.split(".")[0]
    out = []
    for name in (listed if listed is not None else dir(module)):
        if name.startswith("_"):
            continue
        obj = getattr(module, name, None)
        if listed is None:
            if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            if not str(getattr(obj, "__module__", "")).split(".")[0] == top:
                continue
        out.append(name)
    return sorted(out)


def resolve(dotted: str):
    """The object a dotted name stands for: the longest importable module, then attributes."""
    parts = dotted.split(".")
    error = None
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError as exc:
            error = f"{type(exc).__name__}: {exc}"
            continue
        except Exception as exc:  # a module that fails on import is missing to its users too
            return None, f"{type(exc).__name__}: {exc}"
        for attr in parts[cut:]:
            try:
                obj = getattr(obj, attr)
            except AttributeError:
                return None, f"AttributeError: {obj.__name__ if inspect.ismodule(obj) else attr!s} has no {attr!r}"
            except ImportError as exc:  # a name the package refuses with its reason (compat/paths.py)
                return None, f"ImportError: {exc}"
        return obj, None
    return None, error


def params_of(obj):
    target = obj.__init__ if inspect.isclass(obj) else obj
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    out = [[p.name, p.kind.name, p.default is not inspect.Parameter.empty] for p in sig.parameters.values()]
    if inspect.isclass(obj) and out and out[0][0] == "self":
        out = out[1:]
    if inspect.isclass(obj) and target is object.__init__:
        return None
    return out


def describe(dotted: str):
    obj, error = resolve(dotted)
    if error is not None:
        return {"found": False, "kind": None, "params": None, "error": error}
    kind = ("module" if inspect.ismodule(obj) else "class" if inspect.isclass(obj)
            else "function" if callable(obj) else "value")
    return {"found": True, "kind": kind, "params": params_of(obj) if kind in ("class", "function") else None}


def main() -> None:
    request = json.load(sys.stdin)
    answer = {"modules": {}, "names": {}}
    # DeepSpeed prints its accelerator choice on import; keep stdout for the answer
    with contextlib.redirect_stdout(io.StringIO()):
        for module in request.get("modules", []):
            try:
                answer["modules"][module] = public_names(module)
            except Exception as exc:
                answer["modules"][module] = {"error": f"{type(exc).__name__}: {exc}"}
        for name in request.get("names", []):
            answer["names"][name] = describe(name)
    json.dump(answer, sys.stdout)


if __name__ == "__main__":
    main()
