#!/usr/bin/env bash
# Prepare a virtual environment with dslaunch installed (editable) and its test tools.
#
# torch is installed first, pinned, because the dependency "torch>=2.1" resolved on a
# machine with no torch would pull the newest CUDA build (gigabytes): scripts/install_torch.sh
# picks the build (CPU without a GPU; a wheel folder or an index by variable). Where a torch
# is already importable in the venv it is kept, so a GPU box keeps its own build.
# Usage: source-free; prints the venv's bin directory on its last line.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DSLAUNCH_VENV:-$ROOT/.venv}"
PY="${DSLAUNCH_PYTHON:-python3}"

quiet_pip() {
    # The machine's pip config names index folders that may not exist; those warnings are noise.
    "$VENV/bin/pip" install -q --disable-pip-version-check "$@" 2>&1 | { grep -v "is ignored: it is neither" || true; } >&2
    return "${PIPESTATUS[0]}"
}

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating virtual environment $VENV" >&2
    "$PY" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    # which build and from where: DSLAUNCH_TORCH_WHEELS / _INDEX_URL / _BUILD (see install_torch.sh)
    bash "$ROOT/scripts/install_torch.sh" "$VENV"
fi
# Reinstall only when the package metadata changed: an editable install picks up code edits by itself.
STAMP="$VENV/.dslaunch-installed"
SUM="$(cat "$ROOT/pyproject.toml" "$ROOT/setup.py" | cksum)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$SUM" ] || ! "$VENV/bin/python" -c "import dslaunch.launcher" >/dev/null 2>&1; then
    echo "setup: installing dslaunch (editable) with the test, hf and docs extras" >&2
    quiet_pip -e "$ROOT[test,hf,docs]"
    echo "$SUM" > "$STAMP"
fi
echo "$VENV/bin"
