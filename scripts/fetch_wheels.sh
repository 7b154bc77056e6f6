#!/usr/bin/env bash
# Wheels for a GPU machine without network access: everything experiments/gpu_check.sh
# installs there beyond the image's own CUDA torch. Versions are this venv's (what CI tests with),
# for the GPU machine's Python and platform (MEGATRAIN_DEVICE_PYTHON, default 3.12; x86-64 Linux). deepspeed ships only
# as a source package, so it is built here into a pure-Python wheel; its C++ ops are compiled on
# first use on the GPU machine (never ship a built op: they are compiled with -march=native).
#
#   bash scripts/fetch_wheels.sh [DEST]        # DEST defaults to wheels/ (git-ignored, never committed)
#   MEGATRAIN_WHEELS_FULL=1 bash scripts/fetch_wheels.sh   # also numpy/pandas (~30 MB more)
#
# The script reports the total size, for copying the folder over.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST="${1:-wheels}"
PYVER="${MEGATRAIN_DEVICE_PYTHON:-3.12}"
. .venv/bin/activate

mkdir -p "$DEST"
full=()
[ "${MEGATRAIN_WHEELS_FULL:-0}" = "1" ] && full=(--full)
mapfile -t pins < <(python scripts/wheel_list.py "${full[@]}")
binary=()
for p in "${pins[@]}"; do
    [[ "$p" == deepspeed==* ]] || binary+=("$p")
done

# pip matches manylinux tags exactly, so name every glibc level the device (glibc 2.39) can load.
platforms=()
for tag in manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 \
           manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64 \
           manylinux1_x86_64; do
    platforms+=(--platform "$tag")
done
python -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    "${platforms[@]}" -d "$DEST" "${binary[@]}"

ds=$(printf '%s\n' "${pins[@]}" | grep '^deepspeed==' || true)
if [ -n "$ds" ] && ! ls "$DEST"/deepspeed-"${ds#deepspeed==}"-*.whl >/dev/null 2>&1; then
    # No build isolation: its setup.py imports torch, and an isolated build would fetch a CUDA torch.
    python -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" "$ds"
fi

# Drop wheels of versions no longer pinned (one version per package, or pip refuses to choose).
python - "$DEST" "${pins[@]}" <<'PY'
import sys
from pathlib import Path

from packaging.utils import canonicalize_name, parse_wheel_filename

dest, pins = Path(sys.argv[1]), dict(p.split("==") for p in sys.argv[2:])
for whl in dest.glob("*.whl"):
    name, version, _, _ = parse_wheel_filename(whl.name)
    if pins.get(canonicalize_name(name)) != str(version):
        print(f"removing stale {whl.name}")
        whl.unlink()
PY
printf '%s\n' "${pins[@]}" > "$DEST/requirements.txt"
echo "$(ls "$DEST"/*.whl | wc -l) wheels, $(du -sh "$DEST" | cut -f1) in $DEST (limit per device call: 64 MiB with the repo)"
