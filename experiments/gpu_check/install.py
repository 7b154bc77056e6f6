"""Install the carried wheels beside the image's own packages, and say what was found and what was installed.

    python experiments/gpu_check/install.py WHEELS_DIR SITE_DIR

Run by experiments/gpu_check.sh before anything imports torch or the project; standard library only (a bare
image has a driver, Python and torch, maybe not pip). The image's torch is used as found: no wheel of torch or
its CUDA libraries is carried (scripts/wheel_list.py). Every other carried package goes into SITE_DIR (first on
PYTHONPATH afterwards, so ours win over an image's older transformers without touching the image), except one
the image already has at the carried version. With pip: `pip install --no-index --no-deps --target`; without it,
each wheel is unpacked into SITE_DIR as pip would (its console scripts written into SITE_DIR/bin).

Prints one "found:" line (Python, torch and its CUDA, every carried package the image has, at its version) and
one "installed:" line (each package, and the image's version it shadows). Exit code 2 when nothing can run: no
torch, or a wheel that does not install.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

KEY_PACKAGES = ("transformers", "accelerate", "deepspeed", "numpy")  # reported found or missing, wheels or not
_WHEEL = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-[^-]+-[^-]+-[^-]+\.whl$")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name_version(path: Path) -> tuple[str, str]:
    m = _WHEEL.match(path.name)
    if m is None:
        raise ValueError(f"{path.name} is not a wheel file name (name-version-python-abi-platform.whl)")
    return canonical(m["name"]), m["version"]


def image_versions() -> dict[str, str]:
    """{canonical name: version} of what this interpreter finds without the carried folder."""
    out: dict[str, str] = {}
    for d in md.distributions():  # in sys.path order: the first of a name is the one an import gets
        if d.metadata["Name"]:
            out.setdefault(canonical(d.metadata["Name"]), d.version)
    return out


def torch_found() -> str | None:
    """"torch 2.11.0+cu130 (CUDA 13.0)" from its metadata and version.py, without importing it (seconds, and a
    broken CUDA setup would fail here instead of in the env phase, which says more)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return None
    try:
        version = md.version("torch")
    except md.PackageNotFoundError:
        version = "unknown version"
    cuda = None
    vfile = Path(spec.origin).parent / "version.py"
    if vfile.exists():
        m = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", vfile.read_text(), re.M)
        cuda = m.group(1) if m else None
    return f"torch {version} (CUDA {cuda})" if cuda else f"torch {version} (no CUDA build)"


def plan(wheels: list[Path], image: dict[str, str]) -> tuple[list[Path], list[str]]:
    """(wheels to install, packages the image already has at the carried version)."""
    todo, have = [], []
    for w in wheels:
        name, version = wheel_name_version(w)
        if image.get(name) == version:
            have.append(f"{name} {version}")
        else:
            todo.append(w)
    return todo, have


def has_pip(python: str) -> bool:
    return subprocess.run([python, "-m", "pip", "--version"], capture_output=True).returncode == 0


def unpack(wheel: Path, site: Path) -> None:
    """What `pip install --target` does for one wheel: its files into `site`, the .data folder's purelib/platlib
    merged in, scripts into site/bin, and a script for each console entry point."""
    site.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    for data in site.glob("*.data"):
        for sub in data.iterdir():
            dest = site / "bin" if sub.name == "scripts" else site if sub.name in ("purelib", "platlib") else None
            if dest is None:
                continue
            for f in sub.rglob("*"):
                if f.is_file():
                    target = dest / f.relative_to(sub)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    os.replace(f, target)
                    if dest.name == "bin":
                        target.chmod(0o755)
        _rmtree(data)
    name, _ = wheel_name_version(wheel)
    for info in site.glob("*.dist-info"):
        if canonical(info.name.split("-")[0]) == name and (info / "entry_points.txt").exists():
            _console_scripts(info / "entry_points.txt", site / "bin")


def _console_scripts(entry_points: Path, bin_dir: Path) -> None:
    section = None
    for line in entry_points.read_text().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line.strip("[]")
        elif section == "console_scripts" and "=" in line:
            name, _, target = (x.strip() for x in line.partition("="))
            module, _, func = target.partition(":")
            bin_dir.mkdir(parents=True, exist_ok=True)
            script = bin_dir / name
            script.write_text(f"#!{sys.executable}\nimport sys\nfrom {module} import {func.split('.')[0]} as _f\n"
                              f"sys.exit(_f{'.' + func.split('.', 1)[1] if '.' in func else ''}())\n")
            script.chmod(0o755)


def _rmtree(path: Path) -> None:
    for p in sorted(path.rglob("*"), reverse=True):
        p.rmdir() if p.is_dir() else p.unlink()
    path.rmdir()


def install(wheels_dir: Path, site: Path, python: str = sys.executable, use_pip: bool | None = None) -> int:
    wheels = sorted(wheels_dir.glob("*.whl"))
    image = image_versions()
    torch = torch_found()
    found = [f"Python {sys.version.split()[0]}", torch or "NO torch"]
    names = {wheel_name_version(w)[0] for w in wheels} | set(KEY_PACKAGES)
    found += [f"{n} {image[n]}" for n in sorted(names) if n in image]
    found += [f"no {n}" for n in KEY_PACKAGES if n not in image]
    print("found: " + ", ".join(found), flush=True)
    if torch is None:
        print(f"ERROR: {python} has no torch: the check uses the image's own (CUDA) torch and carries none; use an "
              "image with torch, or PYTHON=<an interpreter that has it>", flush=True)
        return 2
    todo, have = plan(wheels, image)
    if have:
        print(f"kept the image's: {', '.join(have)} (the carried version)", flush=True)
    if not wheels:
        print(f"installed: nothing (no wheels in {wheels_dir}/: the check uses what is installed; "
              "bash scripts/fetch_wheels.sh makes them)", flush=True)
        return 0
    if not todo:
        print(f"installed: nothing (the image has every carried package of {wheels_dir}/)", flush=True)
        return 0
    t0 = time.time()
    pip = has_pip(python) if use_pip is None else use_pip
    if pip:
        proc = subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                               "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, todo)])
        if proc.returncode != 0:
            print(f"ERROR: pip could not install the wheels of {wheels_dir}/ (see above); nothing was run", flush=True)
            return 2
    else:
        for w in todo:
            try:
                unpack(w, site)
            except (OSError, zipfile.BadZipFile, ValueError) as exc:
                print(f"ERROR: could not unpack {w.name}: {exc}; nothing was run", flush=True)
                return 2
    how = "with pip" if pip else "by unpacking them (no pip here)"
    items = []
    for w in todo:
        name, version = wheel_name_version(w)
        items.append(f"{name} {version}" + (f" (over the image's {image[name]})" if name in image else ""))
    print(f"installed {len(todo)} wheels into {site} {how} in {time.time() - t0:.0f} s: {', '.join(items)}",
          flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__.splitlines()[2].strip(), file=sys.stderr)
        return 2
    return install(Path(args[0]), Path(args[1]))


if __name__ == "__main__":
    sys.exit(main())
