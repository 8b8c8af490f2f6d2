"""Which tests start processes, read from their code, for the `slow` marker (conftest.py).

A test starts processes when its function, a fixture it uses, or any function or class of the
test suite or of scripts/ they refer to (followed through names, across modules: a helper
imported from dist_harness.py, from another test file or from a script) refers to one of the
ways a process starts: the subprocess and multiprocessing modules, os.fork / os.system /
os.spawn* / os.exec*, the launcher's Supervisor and LocalLink, the kernels' builder.build,
torch.compile. Ranks started by dist_harness.run_function and the dslaunch command are found
that way, since both end in subprocess. Reading the code, not a list kept by hand, means a new
test is marked without anyone remembering to. What runs only inside a library call is not seen:
the build behind an op's first load (CpuAdamOp(isa).load()) compiles once per ops cache, then
loads from it.
"""
from __future__ import annotations

import ast
import functools
import inspect
import sys
import types
from pathlib import Path
from typing import Dict, Optional

TESTS = Path(__file__).resolve().parent
SCRIPTS = TESTS.parent / "scripts"  # loaded as modules by the replaying tests
SPAWNING_MODULES = ("subprocess", "multiprocessing", "torch.multiprocessing", "concurrent.futures.process")
OS_SPAWNS = {"fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp"} | \
    {f"spawn{s}" for s in ("l", "le", "lp", "lpe", "v", "ve", "vp", "vpe")} | \
    {f"exec{s}" for s in ("l", "le", "lp", "lpe", "v", "ve", "vp", "vpe")}
# process starters tests call directly (not through subprocess): the launcher's, the kernels'
# builder.build (every compile of an op goes through it), torch.compile (inductor's compile workers)
SPAWNING_OBJECTS = {("dslaunch.launcher.supervisor", "Supervisor"), ("dslaunch.launcher.head", "LocalLink"),
                    ("dslaunch.kernels.builder", "build"), ("torch", "compile")}


def _spawning_module(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in SPAWNING_MODULES)


def _source_file(obj) -> Optional[str]:
    code = getattr(obj, "__code__", None)
    if code is not None:
        return code.co_filename
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    return getattr(module, "__file__", None)


@functools.lru_cache(maxsize=None)
def _ours_file(path: str) -> bool:
    parents = Path(path).resolve().parents
    return TESTS in parents or SCRIPTS in parents


def _ours(obj) -> bool:
    """Code of the test suite or of the scripts it replays (followed further), not of a library."""
    path = _source_file(obj)
    return path is not None and _ours_file(path)


@functools.lru_cache(maxsize=None)
def _index(path: str):
    """Each file parsed once: its functions by first line (decorators included) and its
    classes by name."""
    tree = ast.parse(Path(path).read_text())
    functions, classes = {}, {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions[node.lineno] = node
            if node.decorator_list:
                functions[node.decorator_list[0].lineno] = node
        elif isinstance(node, ast.ClassDef):
            classes.setdefault(node.name, node)
    return functions, classes


def _definition(obj):
    path = _source_file(obj)
    if path is None or not Path(path).is_file():
        return None
    functions, classes = _index(path)
    code = getattr(obj, "__code__", None)
    if code is not None:
        return functions.get(code.co_firstlineno)
    return classes.get(getattr(obj, "__name__", ""))


def _local_imports(node) -> Dict[str, object]:
    """What the imports inside a function bind (`import subprocess` or `from dist_harness import
    run_function` written in the test itself), from the modules already imported."""
    bound: Dict[str, object] = {}
    for sub in ast.walk(node):
        if isinstance(sub, ast.Import):
            for alias in sub.names:  # only the module's name matters here
                name = alias.name if alias.asname else alias.name.split(".")[0]
                bound[alias.asname or name] = types.ModuleType(name)
        elif isinstance(sub, ast.ImportFrom) and sub.module and not sub.level:
            module = sys.modules.get(sub.module)
            for alias in sub.names:
                if _spawning_module(sub.module):
                    bound[alias.asname or alias.name] = types.ModuleType(sub.module)
                elif module is not None:
                    bound[alias.asname or alias.name] = getattr(module, alias.name, None)
    return bound


class Finder:
    """Remembers each function's answer for the session: helpers are shared by many tests."""

    def __init__(self) -> None:
        self._known: Dict[object, bool] = {}

    def starts_processes(self, obj) -> bool:
        key = getattr(obj, "__code__", obj)
        if key not in self._known:
            self._known[key] = False  # a cycle of helpers adds nothing
            self._known[key] = self._look(obj)
        return self._known[key]

    def _look(self, obj) -> bool:
        node = _definition(obj)
        if node is None:
            return False
        scope = dict(getattr(obj, "__globals__", None) or vars(inspect.getmodule(obj) or types.ModuleType("none")))
        scope.update(_local_imports(node))
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "os" \
                    and sub.attr in OS_SPAWNS:
                return True
            if isinstance(sub, ast.Name) and self._refers_to_spawn(scope.get(sub.id)):
                return True
            if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) \
                    and isinstance(scope.get(sub.value.id), types.ModuleType) \
                    and self._refers_to_spawn(getattr(scope[sub.value.id], sub.attr, None)):
                return True  # module.function: builder.build, dist_harness.run_function
        return False

    def _refers_to_spawn(self, target) -> bool:
        if target is None:
            return False
        try:
            target = inspect.unwrap(target) if callable(target) else target  # functools.cache, wraps
        except ValueError:  # a wrapper loop (a mock object's endless __wrapped__)
            return False
        if isinstance(target, types.ModuleType):
            return _spawning_module(target.__name__)
        module = getattr(target, "__module__", None) or ""
        if _spawning_module(module) or (module, getattr(target, "__name__", "")) in SPAWNING_OBJECTS:
            return True
        if (inspect.isfunction(target) or inspect.isclass(target)) and _ours(target):
            return self.starts_processes(target)
        return False


def item_starts_processes(finder: Finder, item) -> bool:
    """The test's own function, or one of its fixtures defined in the suite."""
    function = getattr(item, "function", None)
    if function is not None and finder.starts_processes(function):
        return True
    info = getattr(item, "_fixtureinfo", None)
    for defs in (info.name2fixturedefs.values() if info is not None else ()):
        for fixturedef in defs:
            func = getattr(fixturedef, "func", None)
            func = inspect.unwrap(func) if func is not None else None  # pytest's fixture wrapper
            if func is not None and _ours(func) and finder.starts_processes(func):
                return True
    return False
