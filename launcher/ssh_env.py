"""Which variables of the head's environment travel to remote workers, and how they are shown.

A remote worker starts from the node agent's environment (what sshd gives a session), so
the head forwards what the job needs explicitly: the `.dslaunch_env` file, every variable
whose name starts with one of FORWARD_PREFIXES, and each `--export NAME`. The values
travel inside the agent's JSON plan, never on a command line a shell would reparse.

Anything the launcher prints shows these values as `***` unless --show_env: they
routinely hold tokens (HF_TOKEN, WANDB keys in .dslaunch_env).
"""
from __future__ import annotations

import re
from typing import Dict, Iterable, Mapping, Sequence

from dslaunch.launcher.errors import LaunchConfigError

FORWARD_PREFIXES = ("NCCL_", "GLOO_", "PYTHON", "CUDA_", "TORCH_", "OMP_", "UCX_", "FI_", "HF_")
MASK = "***"
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def forwarded_env(
    environ: Mapping[str, str], env_file: Mapping[str, str], exports: Sequence[str]
) -> Dict[str, str]:
    """The variables every remote worker gets from the head, file values first, then the prefixes, then --export."""
    out: Dict[str, str] = dict(env_file)
    for name, value in environ.items():
        if name.startswith(FORWARD_PREFIXES):
            out[name] = value
    # CUDA_VISIBLE_DEVICES describes the head's devices, not the remote node's
    out.pop("CUDA_VISIBLE_DEVICES", None)
    for item in exports:
        name, eq, value = item.partition("=")
        if not _NAME_RE.match(name):
            raise LaunchConfigError(f"--export {item!r}: {name!r} is not a valid variable name")
        if eq:
            out[name] = value
        elif name in environ:
            out[name] = environ[name]
        else:
            raise LaunchConfigError(f"--export {name}: not set in the launcher's environment")
    return out


def masked(env: Mapping[str, str], secret_names: Iterable[str], show: bool) -> Dict[str, str]:
    """A copy of env fit for printing: values of secret_names replaced by *** unless show."""
    if show:
        return dict(env)
    hidden = set(secret_names)
    return {k: (MASK if k in hidden else v) for k, v in env.items()}
