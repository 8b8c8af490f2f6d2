#!/usr/bin/env bash
# The main job, set-up included: a 2-process gloo job on the CPU under dslaunch that
# does a real all_reduce (each rank contributes rank+1; both must print 3).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN=$(bash "$ROOT/scripts/setup_env.sh" | tail -n1)
cd "$ROOT"
exec "$BIN/dslaunch" --num_gpus 2 --master_port 0 scripts/examples/allreduce.py "$@"
