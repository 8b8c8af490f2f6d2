"""`dslaunch install-deepspeed-compat [--uninstall] [--target DIR]`.

Installs the `deepspeed` compatibility distribution (compat/deepspeed, shipped inside
dslaunch) into the environment dslaunch runs in, so that code which imports `deepspeed`
(the HF Trainer, Accelerate) runs on dslaunch.runtime; `--uninstall` removes it. A real
DeepSpeed is never replaced or removed: both directions refuse with one line (exit 1).

pip builds from a temporary copy of the distribution: an in-tree build would leave build/
and *.egg-info next to the sources (site-packages, or the repository), and a stale build/
can carry deleted modules into the next wheel.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional

import click

SOURCE = Path(__file__).resolve().parent / "deepspeed"
MARK = "+dslaunch"


def installed_version() -> Optional[str]:
    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return None


def _pip(args: List[str]) -> int:
    return subprocess.call([sys.executable, "-m", "pip", "--disable-pip-version-check", *args])


def _copy_source(into: Path) -> Path:
    dest = into / "deepspeed-compat"
    shutil.copytree(SOURCE, dest, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    return dest


def install(target: Optional[str]) -> int:
    found = installed_version()
    if target is None and found and MARK not in found:
        click.echo(f"dslaunch: error: DeepSpeed {found} is installed in this environment ({sys.prefix}); "
                   f"refusing to replace it with dslaunch's compatibility package "
                   f"(pip uninstall deepspeed first if you mean to)", err=True)
        return 1
    if not (SOURCE / "pyproject.toml").is_file():
        click.echo(f"dslaunch: error: the compatibility package's sources are missing from {SOURCE}", err=True)
        return 1
    # Without build isolation pip needs no index (offline GPU boxes); setuptools must then be here.
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    where = ["--target", target, "--upgrade"] if target else []
    with tempfile.TemporaryDirectory(prefix="dslaunch-compat-") as tmp:
        # --no-cache-dir: a wheel cached under the same version would outlive source changes
        rc = _pip(["install", "-q", "--no-deps", "--no-cache-dir", *isolation, *where, str(_copy_source(Path(tmp)))])
    if rc != 0:
        click.echo(f"dslaunch: error: pip could not install the deepspeed compatibility package (exit {rc})", err=True)
        return rc
    click.echo(f"dslaunch: installed the deepspeed compatibility package into {target or sys.prefix}: "
               "`import deepspeed` and the `deepspeed` command now run dslaunch", err=True)
    return 0


def uninstall() -> int:
    found = installed_version()
    if found is None:
        click.echo("dslaunch: no deepspeed package is installed in this environment; nothing to remove", err=True)
        return 0
    if MARK not in found:
        click.echo(f"dslaunch: error: the installed deepspeed {found} is DeepSpeed itself, not dslaunch's "
                   f"compatibility package; not removing it", err=True)
        return 1
    rc = _pip(["uninstall", "-q", "-y", "deepspeed"])
    if rc == 0:
        click.echo(f"dslaunch: removed the deepspeed compatibility package {found}", err=True)
    return rc


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--uninstall", "remove", is_flag=True, help="Remove the compatibility package instead.")
@click.option("--target", type=click.Path(file_okay=False), default=None,
              help="Install into this folder (pip --target) instead of the current environment.")
def install_deepspeed_compat(remove: bool, target: Optional[str]) -> None:
    """Install the `deepspeed` compatibility package: DeepSpeed's Python API and `deepspeed`
    command served by dslaunch, for code that imports deepspeed (HF Trainer, Accelerate).
    Refuses to replace a real DeepSpeed."""
    if remove and target:
        raise click.UsageError("--uninstall and --target cannot be combined")
    sys.exit(uninstall() if remove else install(target))
