#!/usr/bin/env bash
# The GPU check in one call (about 7 min on an H200): install ./wheels/*.whl when there are any (for a
# machine without network: `bash scripts/fetch_wheels.sh` makes them elsewhere), then run
# `python -m experiments.gpu_check` (see experiments/gpu_check/__init__.py for the phases).
#
#   bash experiments/gpu_check.sh                  # on the GPU machine; results in results/gpu/<UTC time>/
#   bash experiments/gpu_check.sh --only parity    # some phases again
#   bash experiments/gpu_check.sh --dry-run        # the same script on the CPU, tiny shapes
#
# With $OUT set the check copies its 6 most useful files there after every phase, and this wrapper's
# log goes to $OUT/log.txt, so a run cut short still leaves what it did.
set -uo pipefail
cd "$(dirname "$0")/.."
export GPU_CHECK_T0="${GPU_CHECK_T0:-$(date +%s)}"  # the check's time budget counts the install too
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

dry=0
for a in "$@"; do [ "$a" = "--dry-run" ] && dry=1; done
PY="${PYTHON:-python3}"
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && ! python3 -c "import torch" >/dev/null 2>&1; then
    PY=.venv/bin/python  # a dev machine: the project's venv holds torch
fi
LOG=/dev/null
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT"; LOG="$OUT/log.txt"; fi

{
    if [ "$dry" = 0 ] && compgen -G "wheels/*.whl" >/dev/null; then
        # A target folder first on PYTHONPATH: the image's own packages stay untouched, ours win.
        site=/tmp/megatrain-site
        t=$(date +%s)
        if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --target "$site" wheels/*.whl; then
            echo "installed $(ls wheels/*.whl | wc -l) wheels from wheels/ into $site in $(( $(date +%s) - t )) s"
        else
            echo "WARNING: installing wheels/*.whl failed; phases that need them will say so"
        fi
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
        export PATH="$site/bin:$PATH"
        # Fresh per machine: DeepSpeed's ops are compiled with -march=native, never copied between machines.
        export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/megatrain-torch-extensions}"
    elif [ "$dry" = 0 ]; then
        echo "no wheels/ folder: using the installed packages (bash scripts/fetch_wheels.sh makes it)"
    fi
    "$PY" -m experiments.gpu_check "$@"
} 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
