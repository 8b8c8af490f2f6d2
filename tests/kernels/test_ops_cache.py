"""The ops cache is a directory of code this process runs: it must refuse what others could
have planted, never follow a symbolic link, and repair (once) what is merely damaged.

Everything goes through the public interface: `dslaunch build-ops`, and a fresh process
calling CPUAdam.step() / cpu_adam_available() / cpu_adam_info(). A planted library would
announce itself by creating a marker file from its ELF constructor, so "not loaded" is
checked by the absence of its side effect, not only by our own report.
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

from dslaunch.kernels import builder
from dslaunch.kernels.build_cli import build_ops

NOBODY = 65534

PROBE = textwrap.dedent("""
    import json, warnings, torch
    from dslaunch.kernels import CPUAdam, cpu_adam_available, cpu_adam_info
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = torch.nn.Parameter(torch.ones(40))
        p.grad = torch.ones(40)
        CPUAdam([p], lr=0.1).step()
    maps = [line.split()[-1] for line in open("/proc/self/maps") if "ds_cpu_adam" in line]
    print(json.dumps({"available": cpu_adam_available(), "info": cpu_adam_info(), "stepped": bool((p < 1).all()),
                      "warnings": [str(w.message) for w in caught if "dslaunch" in str(w.message)], "maps": sorted(set(maps))}))
""")

PLANTED_C = textwrap.dedent("""
    #include <fcntl.h>
    #include <stdlib.h>
    #include <unistd.h>
    __attribute__((constructor)) static void planted(void) {
      const char* marker = getenv("DS_TEST_MARKER");
      if (marker) close(creat(marker, 0644));
    }
    const char* ds_cpu_adam_isa(void) { return "planted"; }
    int ds_cpu_adam_step(void) { return 0; }
""")


@pytest.fixture(scope="module")
def spec():
    return builder.cpu_adam_spec()


@pytest.fixture(scope="module")
def good_library(tmp_path_factory, spec):
    """A genuine build, for copying into caches under test."""
    return builder.build(spec, tmp_path_factory.mktemp("good-cache")).path


def _compile_c(source: str, out, tmp_path):
    src = tmp_path / "lib.c"
    src.write_text(source)
    subprocess.run(["cc", "-shared", "-fPIC", str(src), "-o", str(out)], check=True, capture_output=True)


def _plant(root, spec, library_bytes, owner=None, record_sha=None):
    """An entry as an attacker (or a damaged disk) leaves it: the library and a build.json."""
    entry = root / builder.entry_name(spec)
    entry.mkdir(parents=True, exist_ok=True)
    lib = entry / f"{spec.name}.so"
    lib.write_bytes(library_bytes)
    sha = record_sha or hashlib.sha256(library_bytes).hexdigest()
    (entry / "build.json").write_text(json.dumps({"name": spec.name, "library": lib.name, "sha256": sha}))
    if owner is not None:
        for path in (entry, lib, entry / "build.json"):
            os.chown(path, owner, owner)
    return entry, lib


def _build_ops(root, env=None):
    result = CliRunner().invoke(build_ops, ["--no-cuda", "--cache-dir", str(root)], env=env)
    return result.exit_code, result.output


def _probe(root, marker=None, **env):
    full = dict(os.environ, **{builder.CACHE_ENV: str(root)}, **env)
    if marker:
        full["DS_TEST_MARKER"] = str(marker)
    run = subprocess.run([sys.executable, "-c", PROBE], env=full, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1]), run.stderr


def _one_line_naming(output: str, path, *words):
    lines = [ln for ln in output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, output
    assert str(path) in lines[0] and all(w in lines[0] for w in words), lines[0]
    assert "Traceback" not in output


@pytest.mark.timeout(240)
def test_shared_1777_cache_with_a_library_planted_by_nobody_is_refused(tmp_path, spec):
    """The reported attack: `nobody` plants a library and build.json (with the right sha256)
    in a world-writable shared cache; root must neither report it as cached nor run it."""
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o1777)
    planted = tmp_path / "planted.so"
    _compile_c(PLANTED_C, planted, tmp_path)
    _plant(root, spec, planted.read_bytes(), owner=NOBODY)
    marker = tmp_path / "PLANTED-CODE-RAN"

    code, out = _build_ops(root)
    assert code == 1 and "cached" not in out
    _one_line_naming(out, root, "world-writable (mode 1777)")

    seen, _ = _probe(root, marker)
    assert not seen["available"] and seen["stepped"]  # torch's AdamW did the step instead
    assert "world-writable" in seen["info"]["error"] and "\n" not in seen["info"]["error"]
    assert any(str(root) in w and "world-writable" in w for w in seen["warnings"])
    assert not marker.exists() and seen["maps"] == []


@pytest.mark.timeout(240)
def test_a_foreign_or_writable_entry_in_a_private_cache_is_refused(tmp_path, spec, good_library):
    root = tmp_path / "cache"
    planted = tmp_path / "planted.so"
    _compile_c(PLANTED_C, planted, tmp_path)
    entry, lib = _plant(root, spec, planted.read_bytes(), owner=NOBODY)
    marker = tmp_path / "PLANTED-CODE-RAN"
    code, out = _build_ops(root)
    assert code == 1
    _one_line_naming(out, entry, f"owned by uid {NOBODY} (nobody)", "refusing")
    seen, _ = _probe(root, marker)
    assert not seen["available"] and seen["stepped"] and not marker.exists() and seen["maps"] == []

    # Ours, but group-writable: anyone in the group could have swapped the library.
    shutil.rmtree(entry)
    entry, lib = _plant(root, spec, good_library.read_bytes())
    os.chmod(lib, 0o775)
    code, out = _build_ops(root)
    assert code == 1
    _one_line_naming(out, lib, "group-writable (mode 775)")


@pytest.mark.timeout(240)
def test_symbolic_links_are_never_followed(tmp_path, spec, good_library):
    victim = tmp_path / "victim"
    entry_name = builder.entry_name(spec)

    # The cache directory itself.
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    code, out = _build_ops(tmp_path / "link")
    assert code == 1
    _one_line_naming(out, tmp_path / "link", "symbolic link")

    # The lock file: a build would create or truncate whatever it points at.
    root = tmp_path / "c1"
    root.mkdir()
    (root / f"{entry_name}.lock").symlink_to(victim)
    code, out = _build_ops(root)
    assert code == 1 and not victim.exists()
    _one_line_naming(out, root / f"{entry_name}.lock", "symbolic link")

    # build.json.tmp: written at the end of a build.
    victim.write_text("precious")
    root = tmp_path / "c2"
    (root / entry_name).mkdir(parents=True)
    (root / entry_name / "build.json.tmp").symlink_to(victim)
    code, out = _build_ops(root)
    assert code == 1 and victim.read_text() == "precious" and not (root / entry_name / "build.json").exists()
    _one_line_naming(out, root / entry_name / "build.json.tmp", "symbolic link")

    # The library, and the entry directory.
    root = tmp_path / "c3"
    entry, lib = _plant(root, spec, good_library.read_bytes())
    lib.unlink()
    lib.symlink_to(good_library)
    code, out = _build_ops(root)
    assert code == 1
    _one_line_naming(out, lib, "symbolic link")
    root = tmp_path / "c4"
    root.mkdir()
    (root / entry_name).symlink_to(entry)
    code, out = _build_ops(root)
    assert code == 1
    _one_line_naming(out, root / entry_name, "symbolic link")


@pytest.mark.timeout(300)
def test_a_damaged_entry_is_rebuilt_once(tmp_path, spec, good_library):
    root = tmp_path / "cache"
    good = good_library.read_bytes()

    # Truncated library: the first CPUAdam.step() rebuilds it and runs the real kernel.
    entry, lib = _plant(root, spec, good)
    lib.write_bytes(good[: len(good) // 2])
    seen, err = _probe(root)
    assert seen["available"] and seen["stepped"] and not seen["info"]["cached"], seen
    assert seen["warnings"] == [] and seen["maps"] == [str(lib)], seen
    assert f"rebuilding {spec.name}" in err and "truncated or modified" in err, err
    code, out = _build_ops(root)
    assert code == 0 and f"{spec.name}: cached" in out

    # Same size, one byte changed: the sha256 in build.json no longer matches.
    data = bytearray(lib.read_bytes())
    data[len(data) // 2] ^= 0xFF
    lib.write_bytes(bytes(data))
    code, out = _build_ops(root)
    assert code == 0 and "sha256" in out and "(the cached library was damaged)" in out, out

    # A well-formed library (with a matching sha256) that lacks the entry points.
    empty = tmp_path / "empty.so"
    _compile_c("int unrelated(void) { return 0; }\n", empty, tmp_path)
    _plant(root, spec, empty.read_bytes())
    code, out = _build_ops(root)
    assert code == 0 and "does not export ds_cpu_adam_step" in out and "damaged" in out, out
    code, out = _build_ops(root)
    assert code == 0 and f"{spec.name}: cached" in out


@pytest.mark.timeout(300)
def test_a_second_failure_says_exactly_what_is_wrong(tmp_path, spec, good_library):
    """Damaged entry, and the rebuild also yields a library without the entry points (a
    compiler that drops them): no AttributeError, no "could not be built", no "None"."""
    fake = tmp_path / "c++"
    fake.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        [ "$1" = "--version" ] && exec c++ --version
        out=""; prev=""
        for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
        [ -n "$out" ] || exec c++ "$@"  # a probe with no output file (a flag check): the real compiler
        printf 'int unrelated(void) {{ return 0; }}\\n' > "$out.c"
        exec cc -shared -fPIC "$out.c" -o "$out"
    """))
    fake.chmod(0o755)
    root = tmp_path / "cache"
    good = good_library.read_bytes()
    _, lib = _plant(root, spec, good[:4096], record_sha=hashlib.sha256(good).hexdigest())
    env = {"CXX": str(fake)}
    assert builder.entry_name(spec) == lib.parent.name

    code, out = _build_ops(root, env=env)
    assert code == 1 and "Traceback" not in out
    for words in ("truncated or modified", "rebuilding it failed", "does not export ds_cpu_adam_step"):
        assert words in out, out
    seen, _ = _probe(root, **env)
    assert not seen["available"] and seen["stepped"]
    cause = seen["info"]["error"]
    assert "does not export ds_cpu_adam_step" in cause and str(lib.parent) in cause
    assert len(seen["warnings"]) == 1 and "AttributeError" not in seen["warnings"][0]
    assert "Cause:\nNone" not in seen["warnings"][0]
