"""Package list for setuptools, found rather than listed.

The code folders sit at the top of the repository and install under one namespace
(launcher/ -> dslaunch.launcher, runtime/ -> dslaunch.runtime, kernels/ -> dslaunch.kernels,
compat/ -> dslaunch.compat).
setuptools' own discovery cannot remap folder names, so every folder below them that holds
an __init__.py becomes dslaunch.<folder>.<sub>...; a new subpackage needs no edit here.

DSLAUNCH_BUILD_OPS=1 (or a list: cpu_adam,cpu_lion,cpu_adagrad,fused_adam) also builds the
ops ahead of time with torch's CppExtension/CUDAExtension (kernels/aot.py says how and
where); it needs `pip install --no-build-isolation`, so that the build sees the torch the
ops will run with.
"""
import os
import sys
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


def _prebuilt_ops() -> dict:
    """ext_modules and the build_ext command for DSLAUNCH_BUILD_OPS; nothing without it."""
    if os.environ.get("DSLAUNCH_BUILD_OPS", "").strip() in ("", "0"):
        return {}
    try:
        from torch.utils.cpp_extension import BuildExtension
    except ImportError:
        sys.exit("DSLAUNCH_BUILD_OPS: torch is not importable in the build environment; install torch first and "
                 "run pip install --no-build-isolation")
    sys.path.insert(0, str(ROOT))
    from kernels import aot  # the source tree's, before dslaunch is installed

    specs = aot.extensions()

    class BuildOps(BuildExtension):
        """torch's BuildExtension, then each library's exports checked and its build.json written."""

        def run(self):
            super().run()
            for ext in self.extensions:
                aot.record(specs[ext.name], Path(self.get_ext_fullpath(ext.name)))

    return {"ext_modules": [aot.make_extension(spec, ROOT) for spec in specs.values()],
            "cmdclass": {"build_ext": BuildOps}}


PACKAGES, PACKAGE_DIR = _packages()
setup(packages=PACKAGES, package_dir=PACKAGE_DIR, **_prebuilt_ops())
