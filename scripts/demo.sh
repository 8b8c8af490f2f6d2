#!/usr/bin/env bash
# The main job, set-up included: GPT-lite (scripts/train_gpt.py) trained as a character-level
# language model on the Python standard library's source by 2 gloo processes on the CPU under
# dslaunch, for a few minutes; rank 0 logs the falling loss. (scripts/examples/allreduce.py is
# the bare all_reduce check.)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN=$(bash "$ROOT/scripts/setup_env.sh" | tail -n1)
cd "$ROOT"
exec "$BIN/dslaunch" --num_gpus 2 --master_port 0 scripts/train_gpt.py --deepspeed_config scripts/train_gpt_config.json "$@"
