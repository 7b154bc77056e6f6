#!/usr/bin/env bash
# Wheels for a GPU machine without network access whose image lacks what the check imports (the image
# experiments/gpu_check/README.md names needs none: its `carry` list is empty): everything
# experiments/gpu_check.sh would install there beyond the image's own CUDA torch. Versions are
# this venv's (what CI tests with), for the GPU machine's Python and platform (MEGATRAIN_DEVICE_PYTHON,
# default 3.12; x86-64 Linux), which is written to DEST/python-version: the check refuses to start on a
# machine whose Python differs. deepspeed ships only as a source package, so it is built here into a
# pure-Python wheel; its C++ ops are compiled on first use on the GPU machine (never ship a built op: they
# are compiled with -march=native).
#
#   bash scripts/fetch_wheels.sh [DEST]        # DEST defaults to wheels/ (git-ignored, never committed)
#   MEGATRAIN_DEVICE_PYTHON=3.11 bash scripts/fetch_wheels.sh   # for a device whose Python is 3.11
#
# The script reports the total size, for copying the folder over.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST="${1:-wheels}"
PYVER="${MEGATRAIN_DEVICE_PYTHON:-3.12}"
. .venv/bin/activate

mkdir -p "$DEST"
mapfile -t pins < <(MEGATRAIN_DEVICE_PYTHON="$PYVER" python scripts/wheel_list.py)
[ "${#pins[@]}" -gt 0 ] || { echo "scripts/wheel_list.py listed nothing" >&2; exit 1; }
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

# Drop wheels no longer asked for (one version per package, or pip refuses to choose; with a range, the
# newest that matches is kept).
python - "$DEST" "${pins[@]}" <<'PY'
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

dest = Path(sys.argv[1])
reqs = {canonicalize_name(r.name): r for r in map(Requirement, sys.argv[2:])}
found = {}
for whl in dest.glob("*.whl"):
    name, version, _, _ = parse_wheel_filename(whl.name)
    found.setdefault(canonicalize_name(name), []).append((version, whl))
for name, wheels in found.items():
    req = reqs.get(name)
    keep = max((v for v, _ in wheels if req is not None and req.specifier.contains(v, prereleases=True)), default=None)
    for version, whl in wheels:
        if version != keep:
            print(f"removing stale {whl.name}")
            whl.unlink()
PY
printf '%s\n' "${pins[@]}" > "$DEST/requirements.txt"
echo "$PYVER" > "$DEST/python-version"  # experiments/gpu_check.sh stops on a device whose Python differs
# What a device run carries: these wheels and the tracked tree (experiments/gpu_check/README.md).
wheels_b=$(du -sb "$DEST" | cut -f1)
tree_b=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -n 1 | cut -f1)
total_mib=$(( (wheels_b + tree_b) / 1048576 ))
echo "$(ls "$DEST"/*.whl | wc -l) wheels, $(( wheels_b / 1048576 )) MiB in $DEST; with the tree ($(( tree_b / 1048576 )) MiB):" \
     "$total_mib MiB of the 64 MiB a device run can carry"
if [ "$total_mib" -ge 64 ]; then
    echo "WARNING: over 64 MiB: the carry would not fit (scripts/wheel_list.py UNUSED leaves out what the check never imports)" >&2
fi
