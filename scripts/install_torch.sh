#!/usr/bin/env bash
# Install torch into a virtual environment that has none: bash scripts/install_torch.sh VENV
# (scripts/setup_env.sh calls it). Which build, from where:
#
#   DSLAUNCH_TORCH_WHEELS=DIR       a folder of wheels (offline machines, a prebuilt wheel)
#   DSLAUNCH_TORCH_INDEX_URL=URL    a package index, e.g. https://download.pytorch.org/whl/cu128
#   otherwise DSLAUNCH_TORCH_BUILD  auto (default) | cpu | cuda; auto is cuda when `nvidia-smi -L`
#                                   lists a GPU. cuda: PyPI's default Linux wheel (a CUDA build).
#                                   cpu: a torch wheel pip already knows locally (its find-links,
#                                   no index), else PyTorch's CPU-only index, never the GBs of CUDA.
#   DSLAUNCH_TORCH_VERSION          the version (default 2.13.0)
#   DSLAUNCH_TORCH_DRY_RUN=1        print the pip commands instead of running them
#
# torch itself is installed first with --no-deps from the chosen source, then a plain
# `pip install torch==VERSION` adds its dependencies (torch is then already satisfied, so
# that second step can never swap the build).
set -euo pipefail
VENV="${1:?usage: install_torch.sh VENV}"
VERSION="${DSLAUNCH_TORCH_VERSION:-2.13.0}"
CPU_INDEX="https://download.pytorch.org/whl/cpu"

run() {
    if [ "${DSLAUNCH_TORCH_DRY_RUN:-0}" = 1 ]; then
        echo "pip $*"
        return 0
    fi
    # The machine's pip config may name index folders that do not exist; those warnings are noise.
    "$VENV/bin/pip" "$@" 2>&1 | { grep -v "is ignored: it is neither" || true; } >&2
    return "${PIPESTATUS[0]}"
}

# pip's own lines say what failed, not what to do about it: one line that does, then stop.
cannot_fetch() {
    echo "setup: error: pip could not install torch==$VERSION from $1 (no network, or the index is" \
         "unreachable from here): set DSLAUNCH_TORCH_WHEELS=DIR (a folder with the torch wheel) or" \
         "DSLAUNCH_TORCH_INDEX_URL=URL (a reachable index or mirror) and run set-up again" >&2
    exit 1
}

build="${DSLAUNCH_TORCH_BUILD:-auto}"
if [ "$build" = auto ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
        build=cuda
    else
        build=cpu
    fi
fi
case "$build" in cpu|cuda) ;; *) echo "setup: error: DSLAUNCH_TORCH_BUILD must be auto, cpu or cuda, got '$build'" >&2; exit 2;; esac

q=(install -q --disable-pip-version-check)
if [ -n "${DSLAUNCH_TORCH_WHEELS:-}" ]; then
    [ -d "$DSLAUNCH_TORCH_WHEELS" ] || { echo "setup: error: DSLAUNCH_TORCH_WHEELS=$DSLAUNCH_TORCH_WHEELS is not a folder" >&2; exit 2; }
    echo "setup: installing torch==$VERSION from the wheels in $DSLAUNCH_TORCH_WHEELS" >&2
    run "${q[@]}" --no-deps --no-index --find-links "$DSLAUNCH_TORCH_WHEELS" "torch==$VERSION"
    extra=(--find-links "$DSLAUNCH_TORCH_WHEELS")
elif [ -n "${DSLAUNCH_TORCH_INDEX_URL:-}" ]; then
    echo "setup: installing torch==$VERSION from $DSLAUNCH_TORCH_INDEX_URL" >&2
    run "${q[@]}" --no-deps --index-url "$DSLAUNCH_TORCH_INDEX_URL" "torch==$VERSION" || cannot_fetch "$DSLAUNCH_TORCH_INDEX_URL"
    extra=()
elif [ "$build" = cuda ]; then
    echo "setup: installing torch==$VERSION (a GPU is present: PyPI's CUDA build)" >&2
    run "${q[@]}" --no-deps "torch==$VERSION" || cannot_fetch "PyPI"
    extra=()
else
    echo "setup: installing torch==$VERSION, CPU build (no GPU here; DSLAUNCH_TORCH_BUILD=cuda to override)" >&2
    local_first=("${q[@]}" --no-deps --no-index "torch==$VERSION")
    cpu_index=("${q[@]}" --no-deps --index-url "$CPU_INDEX" "torch==$VERSION")
    if [ "${DSLAUNCH_TORCH_DRY_RUN:-0}" = 1 ]; then
        echo "pip ${local_first[*]}"
        echo "pip ${cpu_index[*]}  # only when pip knows no local wheel"
    elif ! run "${local_first[@]}" 2>/dev/null; then
        run "${cpu_index[@]}" || cannot_fetch "$CPU_INDEX"
    fi
    extra=()
fi
run "${q[@]}" ${extra[@]+"${extra[@]}"} "torch==$VERSION" || cannot_fetch "PyPI (torch's dependencies)"
