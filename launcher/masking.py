"""Which environment values the launcher may print, and which it shows as `***`.

Two rules, either one hides a value (unless --show_env):
- by origin: every value that came from an env file or from `--export NAME=VALUE`. The user
  wrote those for the workers, and they routinely hold tokens (HF_TOKEN, WANDB_API_KEY);
- by name: a variable whose name looks like a credential (TOKEN, SECRET, PASSWORD, KEY, ...),
  wherever its value came from, e.g. HF_TOKEN forwarded from the launcher's environment.
Everything else prints in clear, so PYTHONUNBUFFERED=1 or NCCL_DEBUG=INFO stay readable.

Every form the plan is shown in (text, JSON, the mpirun/srun command line) goes through
masked(); nothing prints an env dict any other way.
"""
from __future__ import annotations

import re
from typing import AbstractSet, Dict, Mapping

MASK = "***"
# substrings of an upper-cased name; erring towards hiding costs only readability
_SECRET_NAME = re.compile(r"TOKEN|SECRET|PASS|KEY|CREDENTIAL|AUTH|COOKIE|SIGNATURE|PRIVATE|CERT|SESSION")


def looks_secret(name: str) -> bool:
    return bool(_SECRET_NAME.search(name.upper()))


def masked(env: Mapping[str, str], hidden_origin: AbstractSet[str], show: bool = False) -> Dict[str, str]:
    """A copy of env fit for printing."""
    if show:
        return dict(env)
    return {k: (MASK if (k in hidden_origin or looks_secret(k)) else v) for k, v in env.items()}
