"""The distribution installs the code folders under one namespace, dslaunch.* (compat/'s
nested `deepspeed` distribution rides along as package data, never as a top-level module)."""
import subprocess
import sys
import zipfile
import repo_paths

ROOT = repo_paths.ROOT
CODE_FOLDERS = {"launcher": "dslaunch/launcher", "runtime": "dslaunch/runtime", "kernels": "dslaunch/kernels",
                "compat": "dslaunch/compat"}


def test_wheel_holds_every_source_file_under_the_dslaunch_namespace(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
        check=True, capture_output=True, cwd=tmp_path,
    )
    (wheel,) = tmp_path.glob("dslaunch-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    top_level = {n.split("/")[0] for n in names}
    assert top_level <= {"dslaunch", next(n.split("/")[0] for n in names if ".dist-info/" in n)}, top_level
    for folder, installed in CODE_FOLDERS.items():
        for src in (ROOT / folder).rglob("*"):
            if src.is_file() and (src.suffix in {".py", ".cpp", ".cu", ".cuh", ".h"} or src.name == "pyproject.toml") \
                    and "__pycache__" not in src.parts and "build" not in src.parts:
                rel = src.relative_to(ROOT / folder).as_posix()
                assert f"{installed}/{rel}" in names, f"{folder}/{rel} is missing from the wheel (add its package to pyproject.toml)"


def test_console_script_and_module_entry_points_exist():
    from importlib.metadata import entry_points

    scripts = {ep.name: ep.value for ep in entry_points(group="console_scripts")}
    assert scripts.get("dslaunch") == "dslaunch.launcher.main:main"
    import dslaunch.kernels
    import dslaunch.launcher
    import dslaunch.runtime  # noqa: F401

    for generic in ("launcher", "runtime", "kernels"):
        probe = subprocess.run([sys.executable, "-c", f"import {generic}"], capture_output=True, cwd="/")
        assert probe.returncode != 0, f"a top-level module named {generic!r} is importable"
