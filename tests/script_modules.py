"""A scripts/*.py file as a module: the tests that replay what a fixture script records
(scripts/make_ds_*_fixtures.py's cases against DeepSpeed's results under tests/data) or check
a script's own logic load it through here, once per session."""
import importlib.util
import sys

import repo_paths

SCRIPTS = repo_paths.SCRIPTS


def load_script(name: str):
    """scripts/<name>.py, imported under `name` (the same module object on every call), with
    scripts/ on sys.path as when the script runs (they import their siblings: bench_timing)."""
    if name in sys.modules:
        return sys.modules[name]
    if str(SCRIPTS) not in sys.path:
        sys.path.append(str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the file executes
    spec.loader.exec_module(mod)
    return mod
