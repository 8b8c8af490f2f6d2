"""Build backend of the deepspeed compatibility package: setuptools, plus one refusal.

Installing a distribution named "deepspeed" replaces whatever "deepspeed" the environment
has. pip builds before it uninstalls anything, so refusing here keeps a real DeepSpeed
installed. The check asks the interpreter that runs the build (pip's own, i.e. the target
environment's) in isolated mode (-I), which ignores the PYTHONPATH of pip's isolated
build environment and so sees the target's site-packages.
"""
import subprocess
import sys

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403  (the PEP 517/660 hooks we do not wrap)

_PROBE = ("import importlib.metadata as m\n"
          "try:\n    print(m.version('deepspeed'))\n"
          "except m.PackageNotFoundError:\n    pass\n")


def installed_deepspeed_version():
    out = subprocess.run([sys.executable, "-I", "-c", _PROBE], capture_output=True, text=True)
    return out.stdout.strip() or None


def refuse_real_deepspeed():
    found = installed_deepspeed_version()
    if found and "+dslaunch" not in found:
        raise SystemExit(f"deepspeed compatibility package: refusing to install over DeepSpeed {found} "
                         f"(installed for {sys.executable}); uninstall it first (pip uninstall deepspeed) "
                         f"if you mean to replace it with dslaunch")


def _refusing(name):
    hook = getattr(_setuptools, name)

    def wrapped(*args, **kwargs):
        refuse_real_deepspeed()
        return hook(*args, **kwargs)

    wrapped.__name__ = name
    return wrapped


# Every hook that leads to an install (metadata first: pip asks for it before building).
for _name in ("prepare_metadata_for_build_wheel", "build_wheel", "prepare_metadata_for_build_editable",
              "build_editable"):
    globals()[_name] = _refusing(_name)
