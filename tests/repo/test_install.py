"""Installing dslaunch into an environment of one's own (docs/install.md).

- `pip install` into a fresh environment that already has torch keeps that torch, and
  `dslaunch install-deepspeed-compat` / `--uninstall` work there; over a real DeepSpeed both
  the command and a plain `pip install ./compat/deepspeed` refuse and leave it in place.
- scripts/install_torch.sh (what setup_env.sh runs on a machine without torch) picks the build:
  a wheel folder, an index, PyPI's CUDA build with a GPU, else a local CPU wheel or PyTorch's
  CPU index; two of those paths install a stand-in torch wheel for real, offline.

The fresh environments are `python -m venv --without-pip` plus a .pth line that makes this
suite's .venv their "system site-packages" (the same as --system-site-packages over a
Python that has torch): torch, pip and setuptools come from there, so nothing is downloaded.
"""
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import repo_paths

ROOT = repo_paths.ROOT
PURELIB = sysconfig.get_paths()["purelib"]  # this suite's .venv site-packages


def _venv(path: Path, see_suite: bool) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    site = Path(subprocess.run([str(path / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    if see_suite:
        (site / "suite-site.pth").write_text(PURELIB + "\n")
    else:  # a pip that installs into this venv, for scripts that call VENV/bin/pip
        pip = path / "bin" / "pip"
        pip.write_text(f"#!/bin/sh\nexec {sys.executable} -m pip --python {path / 'bin' / 'python'} \"$@\"\n")
        pip.chmod(0o755)
    return site


def _run(argv, **kw):
    kw.setdefault("timeout", 300)
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, **kw)


def _py(venv: Path, code: str):
    return _run([venv / "bin" / "python", "-c", code])


def _copy_tree(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns(".venv", ".git", "build", "dist", "*.egg-info",
                                                             "__pycache__", ".pytest_cache"))
    return dest


def _fake_real_deepspeed(site: Path) -> None:
    (site / "deepspeed").mkdir()
    (site / "deepspeed" / "__init__.py").write_text("__version__ = '0.19.8'\n")
    info = site / "deepspeed-0.19.8.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.19.8\n")
    (info / "RECORD").write_text("deepspeed/__init__.py,,\n")


@pytest.mark.timeout(600)
def test_pip_install_keeps_the_environments_torch_and_the_compat_package_installs_and_uninstalls(tmp_path):
    venv = tmp_path / "env"
    site = _venv(venv, see_suite=True)
    # which torch, from where, without paying for importing it each time
    probe = "import importlib.metadata as m, importlib.util as u; print(m.version('torch'), u.find_spec('torch').origin)"
    torch_before = _py(venv, probe).stdout
    assert torch_before.startswith("2."), torch_before

    src = _copy_tree(ROOT, tmp_path / "src")
    res = _run([venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-build-isolation", src])
    assert res.returncode == 0, res.stderr[-3000:]
    assert _py(venv, probe).stdout == torch_before  # the same torch, from the same place
    where = _py(venv, "import dslaunch.runtime, dslaunch.compat; print(dslaunch.runtime.__file__)").stdout
    assert where.startswith(str(site)), where  # the installed copy, not a source tree
    assert _run([venv / "bin" / "dslaunch", "--help"]).returncode == 0

    dslaunch = venv / "bin" / "dslaunch"
    res = _run([dslaunch, "install-deepspeed-compat"])
    assert res.returncode == 0, res.stderr[-3000:]
    got = _py(venv, "import deepspeed, importlib.metadata as m; print(deepspeed.__file__, m.version('deepspeed'))")
    assert got.stdout.startswith(str(site / "deepspeed")) and "+dslaunch." in got.stdout, got
    assert _run([venv / "bin" / "deepspeed", "--help"]).stdout.startswith("Usage: dslaunch")
    assert _py(venv, probe).stdout == torch_before

    res = _run([dslaunch, "install-deepspeed-compat", "--uninstall"])
    assert res.returncode == 0 and "removed the deepspeed compatibility package" in res.stderr
    assert _py(venv, "import deepspeed").returncode != 0 and not (venv / "bin" / "deepspeed").exists()
    res = _run([dslaunch, "install-deepspeed-compat", "--uninstall"])
    assert res.returncode == 0 and "nothing to remove" in res.stderr

    # a real DeepSpeed is never replaced nor removed
    _fake_real_deepspeed(site)
    res = _run([dslaunch, "install-deepspeed-compat"])
    assert res.returncode == 1 and "DeepSpeed 0.19.8 is installed" in res.stderr and "Traceback" not in res.stderr
    res = _run([venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-build-isolation",
                _copy_tree(ROOT / "compat" / "deepspeed", tmp_path / "compat")])
    assert res.returncode != 0 and "refusing to install over DeepSpeed 0.19.8" in res.stderr, res.stderr[-2000:]
    res = _run([dslaunch, "install-deepspeed-compat", "--uninstall"])
    assert res.returncode == 1 and "is DeepSpeed itself" in res.stderr
    assert _py(venv, "import importlib.metadata as m; print(m.version('deepspeed'))").stdout.strip() == "0.19.8"


def _wheel(folder: Path, version: str) -> Path:
    """A stand-in torch wheel: torch/__init__.py with its version, and the dist-info pip needs."""
    folder.mkdir(exist_ok=True)
    path = folder / f"torch-{version}-py3-none-any.whl"
    info = f"torch-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("torch/__init__.py", f"__version__ = {version!r}\n")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


SCRIPT = ROOT / "scripts" / "install_torch.sh"


def _choice(**env):
    res = _run(["bash", SCRIPT, "/unused"], env={**os.environ, "DSLAUNCH_TORCH_DRY_RUN": "1", **env})
    return res.returncode, res.stdout.splitlines(), res.stderr


def test_install_torch_chooses_the_build():
    rc, cmds, err = _choice(DSLAUNCH_TORCH_BUILD="cpu")
    assert rc == 0 and "CPU build" in err
    assert "--no-index torch==2.13.0" in cmds[0]  # a wheel pip knows locally first,
    assert "--index-url https://download.pytorch.org/whl/cpu" in cmds[1]  # else the CPU-only index
    rc, cmds, err = _choice(DSLAUNCH_TORCH_BUILD="cuda", DSLAUNCH_TORCH_VERSION="2.12.1")
    assert rc == 0 and cmds[0].endswith("--no-deps torch==2.12.1") and "index" not in cmds[0]  # PyPI's CUDA build
    rc, cmds, _ = _choice(DSLAUNCH_TORCH_INDEX_URL="https://download.pytorch.org/whl/cu128")
    assert "--index-url https://download.pytorch.org/whl/cu128" in cmds[0]
    rc, _, err = _choice(DSLAUNCH_TORCH_WHEELS="/no/such/folder")
    assert rc == 2 and "is not a folder" in err
    rc, _, err = _choice(DSLAUNCH_TORCH_BUILD="rocm")
    assert rc == 2 and "must be auto, cpu or cuda" in err
    # every path ends with a plain install that only adds the dependencies of the torch it chose
    assert cmds[-1].endswith("install -q --disable-pip-version-check torch==2.13.0")


def test_install_torch_says_what_to_do_when_the_index_cannot_be_reached(tmp_path):
    """pip fails as it does offline (retries, then an error): one set-up line names the two
    variables that install torch without that index, and the exit status is 1."""
    pip = tmp_path / "venv" / "bin" / "pip"
    pip.parent.mkdir(parents=True)
    pip.write_text("#!/bin/sh\necho \"WARNING: Retrying (Retry(total=4)) after connection broken by "
                   "'NewConnectionError': /whl/cpu/torch/\" >&2\n"
                   "echo 'ERROR: No matching distribution found for torch==2.13.0' >&2\nexit 1\n")
    pip.chmod(0o755)
    res = _run(["bash", SCRIPT, tmp_path / "venv"], env={**os.environ, "DSLAUNCH_TORCH_BUILD": "cpu"})
    assert res.returncode == 1
    hint = [line for line in res.stderr.splitlines() if line.startswith("setup: error:")]
    assert len(hint) == 1 and "from https://download.pytorch.org/whl/cpu" in hint[0], res.stderr
    assert "DSLAUNCH_TORCH_WHEELS=DIR" in hint[0] and "DSLAUNCH_TORCH_INDEX_URL=URL" in hint[0]


@pytest.mark.timeout(300)
def test_install_torch_from_a_wheel_folder_and_from_pips_local_wheels(tmp_path):
    wheels = tmp_path / "wheels"
    _wheel(wheels, "2.13.0+standin")
    offline = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1"}  # nothing but what we name

    venv = tmp_path / "a"
    _venv(venv, see_suite=False)
    res = _run(["bash", SCRIPT, venv], env={**offline, "DSLAUNCH_TORCH_WHEELS": str(wheels)})
    assert res.returncode == 0, res.stderr
    assert _py(venv, "import torch; print(torch.__version__)").stdout.strip() == "2.13.0+standin"

    venv = tmp_path / "b"  # no variables, no GPU: the CPU path takes the wheel pip's find-links offer
    _venv(venv, see_suite=False)
    res = _run(["bash", SCRIPT, venv], env={**offline, "DSLAUNCH_TORCH_BUILD": "cpu", "PIP_FIND_LINKS": str(wheels)})
    assert res.returncode == 0, res.stderr
    assert _py(venv, "import torch; print(torch.__version__)").stdout.strip() == "2.13.0+standin"
