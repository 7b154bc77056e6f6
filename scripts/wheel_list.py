"""Print the packages the GPU check carries to the device, one requirement a line.

The versions are the ones installed in this venv (`name==version`), because that is the combination the
test suite runs with; the device then runs the same code with the same libraries on its own CUDA torch. A
package only the device needs (nvidia-ml-py, the `gpu` extra: NVML's PCIe counters) is not in this venv:
it is carried at the range the project declares for it (`name>=version`). What the device image ships and
must not be shadowed (torch and its CUDA stack, torch's own dependencies) is left out; numpy and pandas
are carried (transformers and experiments/results.py import them, and an image's own may not fit).

    MEGATRAIN_DEVICE_PYTHON=3.12 python scripts/wheel_list.py [ROOT ...]
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import re

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOTS = ("transformers", "accelerate", "deepspeed", "safetensors", "pyyaml", "tqdm", "psutil", "numpy", "pandas",
         "nvidia-ml-py")
# The device's torch build with its CUDA libraries, and what torch itself pulls in: replacing any of
# these under the image's torch could break it, and they are large.
NEVER = re.compile(r"^(torch|torchvision|torchaudio|triton|nvidia-.*|cuda-.*|sympy|mpmath|networkx|jinja2|"
                   r"markupsafe|setuptools|pip|wheel)$")
# Required by a carried package, never imported by the check (every process of a dry run, the ZeRO-3 point
# included, loads none of their modules): the Hub's xet download client and the command-line interfaces' pretty
# printing. Left behind, they keep the carry (wheels and tree) under the 64 MiB a device run can carry
# (experiments/gpu_check/README.md: ~6 MB of ~66).
UNUSED = re.compile(r"^(hf-xet|pygments|rich|click|typer|markdown-it-py|mdurl|shellingham|annotated-doc|tomlkit)$")
CARRIED = {"nvidia-ml-py"}  # NVML's Python bindings: named like the CUDA libraries, but none of torch's
# The project's own declared ranges (pyproject.toml), for a package this venv does not hold.
DECLARED = {"nvidia-ml-py": ">=12"}


def device_env(python: str | None = None) -> dict[str, str]:
    """Environment markers of the GPU machine's interpreter (MEGATRAIN_DEVICE_PYTHON, default 3.12; x86-64
    Linux). The check stops on a device whose Python differs (experiments/gpu_check.sh)."""
    ver = python or os.environ.get("MEGATRAIN_DEVICE_PYTHON", "3.12")
    if not re.fullmatch(r"3\.\d+", ver):
        raise SystemExit(f"MEGATRAIN_DEVICE_PYTHON={ver!r} is not a Python version such as 3.12")
    return {"python_version": ver, "python_full_version": f"{ver}.0", "sys_platform": "linux",
            "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
            "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}


def closure(roots: list[str], env: dict[str, str] | None = None) -> dict[str, str]:
    """{name: requirement} of `roots` and everything they require on the device: `==version` as installed
    here, or the declared range of a device-only package."""
    env = env or device_env()
    installed = {canonicalize_name(d.metadata["Name"]): d for d in md.distributions()}
    out: dict[str, str] = {}
    todo = [canonicalize_name(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in out or (NEVER.match(name) and name not in CARRIED) or UNUSED.match(name):
            continue
        dist = installed.get(name)
        if dist is None:
            if name in DECLARED:
                out[name] = DECLARED[name]
                continue
            raise SystemExit(f"{name} is required but not installed in this venv; run scripts/setup.sh first")
        out[name] = f"=={dist.version}"
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate(env):
                todo.append(canonicalize_name(req.name))
    return dict(sorted(out.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("roots", nargs="*", default=list(ROOTS))
    args = ap.parse_args()
    for name, spec in closure(args.roots).items():
        print(f"{name}{spec}")


if __name__ == "__main__":
    main()
