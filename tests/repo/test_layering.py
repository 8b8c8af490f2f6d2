"""The layering of the code (docs/architecture.md), as contracts import-linter checks and as
the import graph's numbers measured from outside.

- The contracts of pyproject.toml ([tool.importlinter]) hold for the source tree: runtime/
  on its floors (train and inference over the strategies over core), core importing no
  strategy, no strategy importing another, the config without comm or tensor parallelism,
  the engine without the pipeline, the launcher without torch or the runtime.
- The contracts can fail: the same check, run on a copy of the tree with one forbidden
  import added, names the broken contract and the import.
- Every relative import in the code folders, those inside functions too, names a module that
  exists (import-linter skips one that does not, and a moved file leaves such imports behind).
- scripts/import_graph.py's four numbers stay within the goals: at most 7 floors, at most 6
  arrows up, no import loop across packages, no function-level import that hides one.
"""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from script_modules import load_script
import repo_paths

ROOT = repo_paths.ROOT
FOLDERS = ("launcher", "runtime", "kernels", "compat")
LINT = ("import sys\nfrom importlinter.cli import lint_imports\n"
        "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))\n")


def _lint(cwd: Path, pythonpath: str = None):
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, "-c", LINT], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_contracts_hold_for_the_source_tree():
    res = _lint(ROOT)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "0 broken" in res.stdout and " kept" in res.stdout


RELATIVE = re.compile(r"^\s*from (\.+)([\w.]*) import ")


def test_every_relative_import_names_a_module_that_exists():
    missing = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            package = [folder, *path.relative_to(ROOT / folder).parent.parts]
            for n, line in enumerate(path.read_text().splitlines(), 1):
                m = RELATIVE.match(line)
                if not m:
                    continue
                up = len(m.group(1)) - 1  # up to len(package): the dslaunch namespace (`from ...kernels`)
                target = ROOT.joinpath(*package[:len(package) - up], *[p for p in m.group(2).split(".") if p])
                if up > len(package) or not (target.with_suffix(".py").is_file() or (target / "__init__.py").is_file()):
                    missing.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert missing == [], "\n".join(missing)


def _tree_copy(tmp_path: Path) -> Path:
    """The code folders as a `dslaunch` namespace package under tmp_path (found first on
    PYTHONPATH, ahead of the editable install), with the project's contracts beside it."""
    pkg = tmp_path / "dslaunch"
    pkg.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "deepspeed", "*.so", "build")
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, pkg / folder, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return pkg


@pytest.mark.parametrize("where, line, contract", [
    ("runtime/core/config/_probe.py", "from dslaunch.runtime.core import comm\n",
     "the config knows neither comm nor tensor parallelism"),
    ("runtime/core/_probe.py", "from dslaunch.runtime.train import engine\n",
     "core imports no strategy and nothing of train or inference"),
    ("runtime/zero/_probe.py", "def later():\n    from ..moe import layer\n",  # a function-level import counts
     "a strategy imports no other strategy"),
    ("runtime/train/_probe_engine.py", "from ..pipe import module\n", None),  # train may use a strategy: no break
    ("launcher/_probe.py", "import torch\n", "the launcher imports neither torch nor the runtime"),
])
def test_a_forbidden_import_breaks_its_contract(tmp_path, where, line, contract):
    pkg = _tree_copy(tmp_path)
    (pkg / where).write_text(line)
    res = _lint(tmp_path, pythonpath=str(tmp_path))
    probe = "dslaunch." + where[:-3].replace("/", ".")
    if contract is None:
        assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
        return
    assert res.returncode != 0, res.stdout[-4000:]
    broken = res.stdout[res.stdout.index("Broken contracts"):]
    assert contract in " ".join(broken.split()), broken
    assert probe in broken, broken  # the report names the import that broke it


def test_the_engine_contract_names_the_engine(tmp_path):
    """The engine importing the pipeline directly is refused (it may reach it only through
    checkpoint/, which reads the pipeline's files)."""
    pkg = _tree_copy(tmp_path)
    engine = pkg / "runtime" / "train" / "engine.py"
    engine.write_text(engine.read_text() + "\nfrom ..pipe.module import PipelineModule  # noqa: E402\n")
    res = _lint(tmp_path, pythonpath=str(tmp_path))
    assert res.returncode != 0
    assert "the engine imports nothing of the pipeline" in " ".join(res.stdout.split())


def _import_graph():
    return load_script("import_graph")


def test_the_import_graph_meets_its_goals():
    ig = _import_graph()
    m = ig.measure(ig.build(ROOT / "runtime", "dslaunch.runtime"))
    assert m.floors <= 7, m.unit_floor
    assert len(m.upward) <= 6, m.upward
    assert m.loops == [], m.loops
    assert m.hidden == [], m.hidden


def test_the_import_graph_sees_a_hidden_loop(tmp_path):
    """The measure is not blind: a function-level import that closes a loop across packages
    is counted as one, and lifts nothing (floors come from load-time imports)."""
    ig = _import_graph()
    root = tmp_path / "pkg"
    for rel, text in {"__init__.py": "", "a/__init__.py": "", "b/__init__.py": "",
                      "a/x.py": "from ..b import y\n",
                      "b/y.py": "def f():\n    from ..a import x\n"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    m = ig.measure(ig.build(root, "pkg"))
    assert m.hidden == [("pkg.b.y", "pkg.a.x")]
    assert [sorted(loop) for loop in m.loops] == [["pkg.a.x", "pkg.b.y"]]
    assert m.floors == 2 and [(a, b) for a, b, _ in m.upward] == [("b", "a")]
