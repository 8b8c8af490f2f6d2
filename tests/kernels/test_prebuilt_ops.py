"""Ops built ahead of time at `pip install` (DSLAUNCH_BUILD_OPS, kernels/aot.py): the
installed package loads them without a JIT build, through the cache's trust checks, and
they compute bit for bit what the JIT-built op computes.

One op (CPU Adam) is built: `pip install` itself and one compile are most of this file's
time (about 10 s of CPU; more wall time on a loaded machine)."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dslaunch.kernels import aot, builder
import repo_paths

ROOT = repo_paths.ROOT
# What pip needs to build the distribution (pyproject's readme included).
DISTRIBUTION = ("setup.py", "pyproject.toml", "README.md", "launcher", "runtime", "kernels", "compat")

# One Adam run on fixed inputs; prints where the op came from and the results' hashes.
RUN = """
import hashlib, json, torch
import dslaunch.kernels.cpu_adam as ca
gen = torch.Generator().manual_seed(7)
p, m, v = torch.randn(1003, generator=gen), torch.zeros(1003), torch.zeros(1003)
for step in (1, 2, 3):
    ca.cpu_adam_step(p, torch.randn(1003, generator=gen), m, v, step=step, lr=1e-2, weight_decay=0.1)
digest = {k: hashlib.sha256(t.numpy().tobytes()).hexdigest() for k, t in (("p", p), ("m", m), ("v", v))}
print(json.dumps({"module": ca.__file__, "library": str(ca._OP.built.path) if ca._OP.built else None,
                  "error": ca._OP.error, "digest": digest}))
"""


def _run(target: Path, cache: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(target), **{builder.CACHE_ENV: str(cache)})
    proc = subprocess.run([sys.executable, "-c", RUN], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]), stderr=proc.stderr)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The package installed into a fresh target with CPU Adam built ahead of time."""
    tmp = tmp_path_factory.mktemp("aot")
    src, target = tmp / "src", tmp / "target"
    src.mkdir()
    skip = shutil.ignore_patterns("__pycache__", "prebuilt", "*.so", "*.egg-info")
    for name in DISTRIBUTION:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=skip)
        else:
            shutil.copy2(ROOT / name, src / name)
    env = dict(os.environ, **{aot.ENV: "cpu_adam"})
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                           "--no-cache-dir", "--disable-pip-version-check", "-q", "--target", str(target), str(src)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return target


@pytest.mark.timeout(900)
def test_an_installed_prebuilt_op_loads_without_a_jit_build_and_matches_it(installed, tmp_path_factory, tmp_path):
    spec = builder.cpu_adam_spec()
    entry = installed / "dslaunch" / "kernels" / "prebuilt" / builder.prebuilt_entry_name(spec)
    record = json.loads((entry / "build.json").read_text())
    assert record["prebuilt"] and (entry / record["library"]).is_file()

    empty = tmp_path / "cache"
    got = _run(installed, empty)
    assert got["error"] is None and got["module"].startswith(str(installed)), got
    assert got["library"] == str(entry / record["library"])
    assert not empty.exists() or not any(empty.iterdir())  # nothing was compiled

    # The reference: the JIT build (cpp_extension.load into the session's ops cache).
    jit_cache = tmp_path_factory.getbasetemp() / "ops-cache"
    jit = _run(ROOT, jit_cache)
    assert jit["library"].startswith(str(jit_cache)) and got["digest"] == jit["digest"]

    # A damaged prebuilt library (its sha256 no longer matches build.json) is said once
    # and not used: the op comes from the cache instead (the JIT build above, no compile).
    lib = entry / record["library"]
    lib.write_bytes(lib.read_bytes() + b"\0")
    damaged = _run(installed, jit_cache)
    assert damaged["library"] == jit["library"] and damaged["digest"] == jit["digest"]
    assert f"dslaunch: not using the prebuilt {spec.name}, building it: {lib}: sha256" in damaged["stderr"]


def test_an_untrusted_prebuilt_folder_is_refused_in_one_line(monkeypatch, tmp_path):
    """Writable by others: whoever could write there could run code as this user."""
    spec = builder.cpu_adam_spec("scalar")
    prebuilt = tmp_path / "prebuilt"
    (prebuilt / builder.prebuilt_entry_name(spec)).mkdir(parents=True)
    prebuilt.chmod(0o777)
    monkeypatch.setattr(builder, "PREBUILT_DIR", prebuilt)
    with pytest.raises(builder.BuildError) as e:
        builder.build(spec, tmp_path / "cache")
    assert str(e.value).startswith(f"ops cache: {prebuilt}: is world-writable (mode 777)")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("value,names", [("1", list(aot.NAMES)), ("0", []), ("", []),
                                         ("cpu_lion, cpu_adam", ["cpu_lion", "cpu_adam"])])
def test_the_build_flag_names_the_ops(value, names):
    assert aot.requested(value) == names


def test_an_unknown_op_in_the_build_flag_stops_the_install_in_one_line():
    with pytest.raises(SystemExit) as e:
        aot.requested("cpu_adam,fused_lamb")
    assert str(e.value) == ("DSLAUNCH_BUILD_OPS='cpu_adam,fused_lamb': unknown op fused_lamb; expected 1 or a list "
                            "of cpu_adam, cpu_lion, cpu_adagrad, quantizer, fused_adam, quantizer_cuda")
