"""`dslaunch build-ops`: compile the kernels ahead of time into the shared cache.

Run it once per machine image (or per node before a job) so that no rank pays for a
build at start-up. (`DSLAUNCH_BUILD_OPS=1 pip install --no-build-isolation .` builds them
into the package instead; an op found there is reported as prebuilt, not built again.) Prints what was built, where, for which instruction set and how long
it took; a failed build prints the compiler's own error and command and exits 1.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from . import builder


@click.command(name="build-ops", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--isa", type=click.Choice(["auto", *builder.ISA_LEVELS]), default="auto", show_default=True,
              help="Instruction set of the CPU builds (auto: the best this CPU runs).")
@click.option("--cuda/--no-cuda", "cuda", default=None,
              help="Also build the CUDA fused Adam (default: when torch sees a GPU).")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help=f"Build cache (default: ${builder.CACHE_ENV} or ~/.cache/dslaunch/ops).")
@click.option("-v", "--verbose", is_flag=True, help="Show the compiler commands as they run.")
def build_ops(isa: str, cuda, cache_dir, verbose: bool) -> None:
    """Build the kernels (CPU Adam, Lion, Adagrad, ZeRO++'s quantizer; on GPU machines the CUDA ones too)."""
    try:
        level = builder.detect_isa() if isa == "auto" else isa
    except ValueError as e:
        raise click.UsageError(str(e))
    if isa != "auto":
        missing = builder._ISA_NEEDS[level] - builder.cpu_flags()
        if missing:
            raise click.UsageError(f"--isa {level}: this CPU lacks {', '.join(sorted(missing))}")
    root = cache_dir or builder.cache_root()
    specs = [make(level) for make in builder.CPU_OP_SPECS]
    import torch

    if cuda is None:
        cuda = torch.cuda.is_available()
    if cuda:
        try:
            arches = builder._arch_list()
        except ValueError as e:  # e.g. a TORCH_CUDA_ARCH_LIST entry that is not an architecture
            raise click.UsageError(str(e))
        if not os.environ.get(builder.ARCH_ENV, "").strip() and not torch.cuda.is_available():
            # nothing said which GPU: the build must not pick one silently
            sms = ", ".join("sm_" + a.replace(".", "").replace("+PTX", "") for a in arches)
            click.echo(f"build-ops: no GPU visible: the CUDA fused Adam targets {sms} (compute capability "
                       f"{', '.join(arches)}), the default; for another GPU set {builder.ARCH_ENV}, "
                       "e.g. 8.0 for an A100", err=True)
        specs += [builder.fused_adam_spec(arches), builder.quantizer_cuda_spec(arches)]
    failed = False
    for spec in specs:
        try:
            built = builder.build(spec, root, verbose=verbose)
        except builder.BuildError as e:
            click.echo(f"build-ops: {e}", err=True)
            if str(e).startswith("ops cache:"):  # the cache itself is unusable: no op can be built
                sys.exit(1)
            failed = True
            continue
        if built.extra.get("prebuilt"):
            how = "prebuilt at install (DSLAUNCH_BUILD_OPS)"
        elif built.cached:
            how = "cached"
        else:
            how = f"built in {built.extra.get('build_seconds', built.seconds):.1f} s"
            if built.rebuilt_because:
                how += " (the cached library was damaged)"
        click.echo(f"{spec.name}: {how}, instruction set {built.isa}, torch {torch.__version__}, "
                   f"sha256 {built.sha256[:16]} (checked, with its exports)\n  {built.path}")
    if failed:
        click.echo("build-ops: the optimizers will fall back to torch's own kernels", err=True)
        sys.exit(1)
