#!/usr/bin/env bash
# The whole test suite, set-up included: bash scripts/test.sh [PYTEST_ARGS...]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_system.sh"
BIN="$(bash "$ROOT/scripts/setup_env.sh" | tail -n 1)"
export PATH="$BIN:$PATH"
cd "$ROOT"
exec python -m pytest "$@"
