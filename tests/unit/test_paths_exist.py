"""Every repository path named in the README, docs/ and megatrain/'s own text exists.

A path is matched where it starts with a folder of the repository or of a package (`engine/host/store.py` is read
under megatrain/, as the package's own comments name it); paths in DeepSpeed's or transformers' trees are written
as dotted module names, so they are not read as ours. Results files named with a placeholder (`<model>`) are not
matched.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_FOLDERS = ("megatrain|experiments|baselines|tests|scripts|docs|examples|notebooks|results|engine|planner|costs|"
            "models|host|layer|pipeline|update|runtime|parallel|model|deepspeed|accelerate|integrations|commands|"
            "config|run|files|metrics|backend")
PATH = re.compile(rf"(?<![\w./-])((?:{_FOLDERS})/[\w./-]*\w\.(?:py|md|yaml|yml|json|sh|csv|ipynb|c|toml))")
BASES = ("", "megatrain", "megatrain/engine")


def texts(root: Path) -> list[str]:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=root, capture_output=True,
                           text=True, check=True).stdout.split()
    return [f for f in files if not f.startswith("results/") and (root / f).is_file()
            and (f.endswith(".md") or (f.startswith("megatrain/") and f.endswith(".py")))]


def stale_paths(root: Path = ROOT) -> list[str]:
    bad = []
    for f in texts(root):
        for i, line in enumerate((root / f).read_text().splitlines(), 1):
            for m in PATH.finditer(line):
                p = m.group(1)
                if not any((root / base / p).exists() for base in BASES) and not (root / f).parent.joinpath(p).exists():
                    bad.append(f"{f}:{i}: {p}")
    return bad


def test_every_named_path_exists():
    assert stale_paths() == []


def test_a_planted_stale_path_is_caught(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "megatrain" / "engine" / "host").mkdir(parents=True)
    (tmp_path / "megatrain" / "engine" / "host" / "store.py").write_text("")
    (tmp_path / "README.md").write_text("see engine/host/store.py and megatrain/engine/tiling.py\n")
    assert stale_paths(tmp_path) == ["README.md:1: megatrain/engine/tiling.py"]
