"""Every repository path named in the README, docs/, and the text of megatrain/, experiments/ and tests/ exists.

A path is matched where it starts with a folder of the repository or of a package (`engine/host/store.py` is read
under megatrain/, as the package's own comments name it); paths in DeepSpeed's or transformers' trees are written
as dotted module names, so they are not read as ours. Results files named with a placeholder (`<model>`) are not
matched. In tests/ only the prose is read (comments and docstrings): a test's string literals name the files it
plants in a temporary folder, or files it opens, which fail it when they are missing.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_FOLDERS = ("megatrain|experiments|baselines|tests|scripts|docs|examples|notebooks|results|engine|planner|costs|"
            "models|host|layer|pipeline|update|runtime|parallel|model|deepspeed|accelerate|integrations|commands|"
            "config|run|files|metrics|backend")
PATH = re.compile(rf"(?<![\w./-])((?:{_FOLDERS})/[\w./-]*\w\.(?:py|md|yaml|yml|json|sh|csv|ipynb|c|toml))")
BASES = ("", "megatrain", "megatrain/engine")
SOURCES = ("megatrain/", "experiments/", "tests/")


def texts(root: Path) -> list[str]:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=root, capture_output=True,
                           text=True, check=True).stdout.split()
    return [f for f in files if not f.startswith("results/") and (root / f).is_file()
            and (f.endswith(".md") or (f.startswith(SOURCES) and f.endswith(".py")))]


def prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of a Python file's comments and docstrings."""
    found = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
             if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                found += [(first.lineno + k, line) for k, line in enumerate(first.value.value.splitlines())]
    return sorted(found)


def lines_of(root: Path, f: str) -> list[tuple[int, str]]:
    text = (root / f).read_text()
    return prose(text) if f.startswith("tests/") and f.endswith(".py") else list(enumerate(text.splitlines(), 1))


def stale_paths(root: Path = ROOT, allowed: set[str] = frozenset()) -> list[str]:
    bad = []
    for f in texts(root):
        for i, line in lines_of(root, f):
            for m in PATH.finditer(line):
                p = m.group(1)
                if f"{f}: {p}" in allowed:
                    continue
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
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        '"""Tests engine/host/store.py and engine/gone.py."""\n'
        'PLANTED = "megatrain/planted.py"  # a fixture; but this comment names experiments/gone.py\n')
    assert stale_paths(tmp_path) == ["README.md:1: megatrain/engine/tiling.py", "tests/test_x.py:1: engine/gone.py",
                                     "tests/test_x.py:2: experiments/gone.py"]
    assert stale_paths(tmp_path, allowed={"tests/test_x.py: engine/gone.py"}) == [
        "README.md:1: megatrain/engine/tiling.py", "tests/test_x.py:2: experiments/gone.py"]
