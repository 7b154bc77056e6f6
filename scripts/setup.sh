#!/usr/bin/env bash
# One set-up for a fresh CPU machine: a venv with the local CPU torch wheel pinned (an unpinned
# torch pulls a multi-GB CUDA build), then the package with its extras.
#   bash scripts/setup.sh          -> venv + package + deepspeed (main job)
#   bash scripts/setup.sh test     -> same, plus the dev tools
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -d .venv ] || "$PY" -m venv .venv
. .venv/bin/activate
if ! python -c "import torch" >/dev/null 2>&1; then
    python -m pip install -q "torch==${MEGATRAIN_TORCH_VERSION:-2.13.0}"
fi
extras="deepspeed,sft"
[ "${1:-}" = "test" ] && extras="deepspeed,sft,dev"
python -m pip install -q -e ".[${extras}]"
# DeepSpeed JIT-builds its C++ ops on first use (~85 s): do it here, once, rather than inside a
# sweep point's or a test's time limit.
python -m baselines.zero3 --build-ops
