#!/usr/bin/env bash
# Run on a lent GPU machine (the `device` tool): makes dslaunch importable without pip
# (no network there; the machine's own CUDA torch is kept), then runs the gpu-marked tests
# and the --cuda benchmarks, writing logs under $OUT. Usage: bash scripts/gpu/session.sh [PART...]
# PARTs: tests adam engine (default: all three).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${OUT:-/tmp/gpu-out}"; mkdir -p "$OUT"
SITE=/tmp/dslaunch-site; mkdir -p "$SITE/dslaunch" "$SITE/bin"
for pkg in launcher runtime kernels; do ln -sfn "$ROOT/$pkg" "$SITE/dslaunch/$pkg"; done
printf '#!/bin/sh\nexec python3 -m dslaunch.launcher.main "$@"\n' > "$SITE/bin/dslaunch"; chmod +x "$SITE/bin/dslaunch"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH" PYTHONUNBUFFERED=1
cd "$ROOT"
PARTS=("$@"); [ ${#PARTS[@]} -eq 0 ] && PARTS=(tests adam engine)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" | tee -a "$OUT/device.txt"
for part in "${PARTS[@]}"; do
  case "$part" in
    tests)
      # only files whose imports exist there (paramiko is not installed on the device image)
      files=$(grep -rl --include="test_*.py" "mark.gpu" tests | xargs grep -L "paramiko\|testbed" | tr '\n' ' ')
      python3 -m pytest -p no:cacheprovider -q -m gpu $files -o addopts="" 2>&1 | tee "$OUT/gpu-tests.log" ;;
    adam)
      python3 scripts/bench_adam.py --cuda --no-default --threads 8 2>&1 | tee "$OUT/bench-adam.log" ;;
    engine)
      for stage in 0 1 2 3; do
        python3 - "$stage" <<'PY' 2>&1 | tee -a "$OUT/engine.log"
import json, sys, tempfile, runpy
stage = int(sys.argv[1])
cfg = json.load(open("scripts/train_gpt_config.json"))
cfg["zero_optimization"]["stage"] = stage
cfg["bf16"] = {"enabled": True}
cfg["train_batch_size"] = 16; cfg["train_micro_batch_size_per_gpu"] = 16
path = tempfile.mktemp(suffix=".json"); json.dump(cfg, open(path, "w"))
sys.argv = ["train_gpt.py", "--steps", "60", "--deepspeed_config", path]
print(f"== GPT-lite on one GPU, bf16, ZeRO stage {stage}")
runpy.run_path("scripts/train_gpt.py", run_name="__main__")
PY
      done ;;
    *) bash "$ROOT/scripts/gpu/$part.sh" 2>&1 | tee "$OUT/$part.log" ;;
  esac
done
