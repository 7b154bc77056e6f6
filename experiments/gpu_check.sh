#!/usr/bin/env bash
# The GPU check in one call (at most 280 s from here, the bench >= 120 s of it: experiments/gpu_check/README.md,
# which gives the time plan and the `carry` list). On the GPU image it expects nothing is installed; on another,
# ./wheels/*.whl go in beside the image's own torch (`bash scripts/fetch_wheels.sh` makes them elsewhere). Then
# `python -m experiments.gpu_check` runs (see experiments/gpu_check/__init__.py for the phases).
#
#   bash experiments/gpu_check.sh                  # on the GPU machine; results in results/gpu/<UTC time>/
#   bash experiments/gpu_check.sh --only parity    # some phases again
#   bash experiments/gpu_check.sh --dry-run        # the same script on the CPU, tiny shapes
#
# MEGATRAIN_WHEELS names another wheel folder. Wheels made for another Python stop the check before anything
# runs (scripts/fetch_wheels.sh records theirs; MEGATRAIN_DEVICE_PYTHON=X.Y makes them for X.Y).
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

WHEELS="${MEGATRAIN_WHEELS:-wheels}"

{
    if [ "$dry" = 0 ] && compgen -G "$WHEELS/*.whl" >/dev/null; then
        # The wheels' Python (fetch_wheels.sh writes it; else a binary wheel's cpXY tag) must be this one's:
        # binary wheels for another Python do not import, and every phase would fail on the device.
        want=$(cat "$WHEELS/python-version" 2>/dev/null || true)
        if [ -z "$want" ]; then
            tag=$(ls "$WHEELS"/*.whl | grep -o -- '-cp3[0-9]*-' | head -n 1 | tr -d -- '-cp')
            [ -n "$tag" ] && want="3.${tag#3}"
        fi
        have=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
        if [ -n "$want" ] && [ "$want" != "$have" ]; then
            echo "ERROR: the wheels in $WHEELS/ are for Python $want but $PY is Python $have; nothing was installed" \
                 "or run. Make them for this machine (MEGATRAIN_DEVICE_PYTHON=$have bash scripts/fetch_wheels.sh)" \
                 "or run with PYTHON=python$want"
            exit 2
        fi
        # A target folder first on PYTHONPATH: the image's own packages (its torch included) stay untouched,
        # ours win. install.py says what it found (torch and its CUDA, the image's versions) and what it installed.
        site=/tmp/megatrain-site
        "$PY" experiments/gpu_check/install.py "$WHEELS" "$site" || exit 2
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
        export PATH="$site/bin:$PATH"
        # Fresh per machine: DeepSpeed's ops are compiled with -march=native, never copied between machines.
        export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/megatrain-torch-extensions}"
    elif [ "$dry" = 0 ]; then
        "$PY" experiments/gpu_check/install.py "$WHEELS" /tmp/megatrain-site || exit 2  # says what it found
    fi
    "$PY" -m experiments.gpu_check "$@"
} 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
