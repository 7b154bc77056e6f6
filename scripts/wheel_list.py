"""Print `name==version` for the packages the GPU check carries to the device, one a line.

The versions are the ones installed in this venv, because that is the combination the test suite
runs with; the device then runs the same code with the same libraries on its own CUDA torch. What
the device image already ships and must not be shadowed (torch and its CUDA stack, torch's own
dependencies) is left out, as are large packages the image carries in compatible versions, unless
asked for with --full.

    python scripts/wheel_list.py [--full] [ROOT ...]
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOTS = ("transformers", "accelerate", "deepspeed", "safetensors", "pyyaml", "tqdm", "psutil", "pandas")
# The device's torch build with its CUDA libraries, and what torch itself pulls in: replacing any of
# these under the image's torch could break it, and they are large.
NEVER = re.compile(r"^(torch|torchvision|torchaudio|triton|nvidia-.*|cuda-.*|sympy|mpmath|networkx|jinja2|"
                   r"markupsafe|setuptools|pip|wheel)$")
# Usually in a CUDA image already, in versions our code accepts; ~30 MB of wheels.
IMAGE_HAS = {"numpy", "pandas", "python-dateutil", "tzdata", "six"}
# The GPU machine's interpreter (Python 3.12 on x86-64 Linux by default), for environment markers.
DEVICE_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
              "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}


def closure(roots: list[str], full: bool) -> dict[str, str]:
    """{name: installed version} of `roots` and everything they require on the device."""
    installed = {canonicalize_name(d.metadata["Name"]): d for d in md.distributions()}
    out: dict[str, str] = {}
    todo = [canonicalize_name(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in out or NEVER.match(name) or (not full and name in IMAGE_HAS):
            continue
        dist = installed.get(name)
        if dist is None:
            raise SystemExit(f"{name} is required but not installed in this venv; run scripts/setup.sh first")
        out[name] = dist.version
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate(DEVICE_ENV):
                todo.append(canonicalize_name(req.name))
    return dict(sorted(out.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="also fetch numpy, pandas and their helpers")
    ap.add_argument("roots", nargs="*", default=list(ROOTS))
    args = ap.parse_args()
    for name, version in closure(args.roots, args.full).items():
        print(f"{name}=={version}")


if __name__ == "__main__":
    main()
