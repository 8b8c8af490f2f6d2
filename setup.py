"""Package list for setuptools, found rather than listed.

The code folders sit at the top of the repository and install under one namespace
(launcher/ -> dslaunch.launcher, runtime/ -> dslaunch.runtime, kernels/ -> dslaunch.kernels,
compat/ -> dslaunch.compat).
setuptools' own discovery cannot remap folder names, so every folder below them that holds
an __init__.py becomes dslaunch.<folder>.<sub>...; a new subpackage needs no edit here.
"""
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
CODE_FOLDERS = ("launcher", "runtime", "kernels", "compat")


def _in_other_distribution(rel: Path) -> bool:
    """Below a folder with its own pyproject.toml (compat/deepspeed): a separate distribution,
    shipped as package data of dslaunch.compat, not as dslaunch.* packages."""
    return any((ROOT / Path(*rel.parts[:i]) / "pyproject.toml").is_file() for i in range(2, len(rel.parts) + 1))


def _packages():
    found, dirs = [], {}
    for folder in CODE_FOLDERS:
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            rel = init.parent.relative_to(ROOT)
            if "__pycache__" in rel.parts or _in_other_distribution(rel):
                continue
            name = "dslaunch." + ".".join(rel.parts)
            found.append(name)
            dirs[name] = rel.as_posix()
    return found, dirs


PACKAGES, PACKAGE_DIR = _packages()
setup(packages=PACKAGES, package_dir=PACKAGE_DIR)
