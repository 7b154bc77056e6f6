"""The harness is a client of the library: experiments/ never imports `megatrain.commands` (what both need lives in
the library: metrics/bench.py, models/lookup.py), and megatrain/ reaches experiments/ through one entry only,
`experiments.cli`, from the `megatrain` command (commands/cli.py). Imports are read from the source, lazy ones
included, so nothing is executed."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_layering import copy_of_the_tree, imports_of

ROOT = Path(__file__).resolve().parents[2]
ENTRY = "experiments.cli"
ENTRY_USER = "megatrain/commands/cli.py"


def _is(target: str, package: str) -> bool:
    return target == package or target.startswith(package + ".")


def harness_on_commands(root: Path = ROOT) -> list[str]:
    bad = []
    for path in sorted((root / "experiments").rglob("*.py")):
        rel = str(path.relative_to(root))
        for line, target in imports_of(path, root):
            if _is(target, "megatrain.commands"):
                bad.append(f"{rel}:{line} imports {target}")
    return bad


def library_on_harness(root: Path = ROOT) -> list[str]:
    bad = []
    for path in sorted((root / "megatrain").rglob("*.py")):
        rel = str(path.relative_to(root))
        for line, target in imports_of(path, root):
            if _is(target, "experiments") and not (rel == ENTRY_USER and _is(target, ENTRY)):
                bad.append(f"{rel}:{line} imports {target}")
    return bad


def test_the_harness_never_imports_the_commands():
    assert harness_on_commands() == []


def test_the_library_reaches_the_harness_through_its_one_entry():
    assert library_on_harness() == []
    # and the entry is used: the command's sweep, report and benchmark point go through it
    targets = {t for _, t in imports_of(ROOT / ENTRY_USER)}
    assert {f"{ENTRY}.sweep", f"{ENTRY}.report", f"{ENTRY}.run_point"} <= targets



@pytest.mark.parametrize(("where", "planted", "check", "expect"), [
    ("experiments/studies/planted.py", "def f():\n    from megatrain.commands.plan import run_sweep\n",
     harness_on_commands, "experiments/studies/planted.py:2 imports megatrain.commands.plan"),
    ("experiments/planted.py", "from megatrain import commands\n", harness_on_commands,
     "experiments/planted.py:1 imports megatrain.commands"),
    ("megatrain/commands/planted.py", "from experiments.runner import run_sweep\n", library_on_harness,
     "megatrain/commands/planted.py:1 imports experiments.runner"),
    ("megatrain/metrics/planted.py", "def f():\n    from experiments.cli import sweep\n", library_on_harness,
     "megatrain/metrics/planted.py:2 imports experiments.cli"),
])
def test_a_planted_import_is_caught(tmp_path, where, planted, check, expect):
    root = copy_of_the_tree(tmp_path)
    (root / where).write_text(planted)
    bad = check(root)
    assert expect in bad and all(where in b for b in bad), bad
