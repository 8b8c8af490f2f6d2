#!/usr/bin/env bash
# The GPU check, in one command, on a bare machine with an NVIDIA GPU and no network:
#
#     bash scripts/gpu_check.sh [--out DIR] [--only a,c] [--budget SECONDS] [--wheels DIR] [--dry-run]
#
# It proves dslaunch's GPU paths and measures them against torch and DeepSpeed (the steps are in
# scripts/gpu_check.py's docstring), each step under its own time limit, and writes
# gpu_report.md, gpu_report.json and gpu_check.log into --out (default: the current folder).
# Without a GPU every step reports "skipped: no GPU". The machine's own python3 and CUDA torch
# are used; dslaunch runs from this checkout without being installed.
#
# Packages the GPU machine lacks (DeepSpeed 0.19.8 and what it needs there) travel as wheels:
# on a machine with PyPI, `bash scripts/gpu_check.sh --fetch-wheels [DIR]` (default .whl/) fills
# the folder; on the GPU machine --wheels DIR (default .whl/ when it exists) installs them into a
# private folder first. PYTHON picks the interpreter (default python3).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
WHEELS=""
ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --wheels) WHEELS="$2"; shift 2 ;;
        --wheels=*) WHEELS="${1#--wheels=}"; shift ;;
        --fetch-wheels)
            DIR="${2:-$ROOT/.whl}"
            mkdir -p "$DIR" || exit 1
            # DeepSpeed's own wheel is pure Python when built with no ops (they build on first use)
            DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DIR" deepspeed==0.19.8 || exit 1
            # what it needs that the CUDA image lacks, for the image's Python 3.12
            for spec in hjson==3.1.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
                        typing-inspection==0.4.5 typing_extensions==4.16.0; do
                "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
                    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
                    --platform any -d "$DIR" "$spec" || exit 1
            done
            ls "$DIR"
            exit 0 ;;
        *) ARGS+=("$1"); shift ;;
    esac
done
if ! command -v "$PY" >/dev/null 2>&1; then
    echo "gpu_check: no $PY on PATH (set PYTHON)" >&2
    exit 2
fi
[ -z "$WHEELS" ] && [ -d "$ROOT/.whl" ] && WHEELS="$ROOT/.whl"
SITE="$(mktemp -d /tmp/gpu-check-site.XXXXXX)"
trap 'rm -rf "$SITE"' EXIT
if [ -n "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE/wheels" \
            "$WHEELS"/*.whl >"$SITE/pip.log" 2>&1; then
        echo "gpu_check: the wheels in $WHEELS did not install (going on without them): $(tail -n 1 "$SITE/pip.log")" >&2
    fi
    export PYTHONPATH="$SITE/wheels${PYTHONPATH:+:$PYTHONPATH}"
fi
# dslaunch from this checkout: its three folders under one dslaunch/ namespace, and a `dslaunch`
# command, unless an installed dslaunch already imports
if ! "$PY" -c "import dslaunch.runtime, dslaunch.launcher, dslaunch.kernels" >/dev/null 2>&1; then
    mkdir -p "$SITE/src/dslaunch" "$SITE/bin"
    for pkg in launcher runtime kernels; do ln -sfn "$ROOT/$pkg" "$SITE/src/dslaunch/$pkg"; done
    printf '#!/bin/sh\nexec %s -m dslaunch.launcher.main "$@"\n' "$PY" > "$SITE/bin/dslaunch"
    chmod +x "$SITE/bin/dslaunch"
    export PYTHONPATH="$SITE/src${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"
fi
export PYTHONUNBUFFERED=1
cd "$ROOT"
"$PY" "$ROOT/scripts/gpu_check.py" "${ARGS[@]}"
