"""The planner has a front door: the commands (megatrain/commands/), the measurements (megatrain/metrics/: `megatrain
bench` fits engine times against the planner's compute model) and the harness (experiments/) import
`megatrain.planner`'s exported names only (its `__all__`), never one of its modules; and the planner never imports
the commands (`python -m megatrain.planner` runs without them). Imports are read from the source, lazy ones
included, so nothing is executed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from test_layering import _absolute, copy_of_the_tree, imports_of

ROOT = Path(__file__).resolve().parents[2]
PLANNER = "megatrain.planner"
CLIENTS = ("megatrain/commands", "megatrain/metrics", "experiments")


def exported(root: Path = ROOT) -> set[str]:
    """The names in megatrain/planner/__init__.py's `__all__`, read from the source."""
    tree = ast.parse((root / "megatrain" / "planner" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError("megatrain/planner/__init__.py has no __all__")


def past_the_front(root: Path = ROOT) -> list[str]:
    """Imports of a planner module, or of a name the planner does not export, from the commands or the harness."""
    names, bad = exported(root), []
    for folder in CLIENTS:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root)
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    targets = [(a.name, None) for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    base = _absolute(path, node, root)
                    targets = [(base, a.name) for a in node.names]
                else:
                    continue
                for module, name in targets:
                    if module.startswith(PLANNER + "."):
                        bad.append(f"{rel}:{node.lineno} imports {module}")
                    elif module == PLANNER and name is not None and name not in names:
                        bad.append(f"{rel}:{node.lineno} imports {PLANNER}.{name}, not in its __all__")
    return bad


def planner_on_commands(root: Path = ROOT) -> list[str]:
    bad = []
    for path in sorted((root / "megatrain" / "planner").rglob("*.py")):  # __main__.py included
        for line, target in imports_of(path, root):
            if target == "megatrain.commands" or target.startswith("megatrain.commands."):
                bad.append(f"{path.relative_to(root)}:{line} imports {target}")
    return bad


def test_the_commands_and_the_harness_use_the_front_door():
    assert past_the_front() == []


def test_the_planner_never_imports_the_commands():
    assert planner_on_commands() == []


def test_every_exported_name_exists_and_the_commands_use_the_front_door():
    import megatrain.planner as planner

    assert all(hasattr(planner, n) for n in planner.__all__), set(planner.__all__) - set(dir(planner))
    # the command reaches the planner: its plan flags and printing are the planner's (cli.py)
    targets = {t for _, t in imports_of(ROOT / "megatrain" / "commands" / "plan.py")}
    assert {f"{PLANNER}.add_plan_args", f"{PLANNER}.run_plan"} <= targets


def test_python_m_megatrain_planner_runs_without_the_commands():
    import subprocess
    import sys

    code = ("import sys, runpy; sys.argv = ['megatrain.planner', '--list-hardware']\n"
            "try:\n    runpy.run_module('megatrain.planner', run_name='__main__')\n"
            "except SystemExit as e:\n    assert e.code == 0, e.code\n"
            "print(sorted(m for m in sys.modules if m.startswith('megatrain.commands')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "h200-pcie" in out.stdout and out.stdout.strip().splitlines()[-1] == "[]", out.stdout



@pytest.mark.parametrize(("where", "planted", "check", "expect"), [
    ("experiments/studies/planted.py", "def f():\n    from megatrain.planner.step_time import layer_costs\n",
     past_the_front, "experiments/studies/planted.py:2 imports megatrain.planner.step_time"),
    ("experiments/planted.py", "from megatrain.planner import long_context_plan\n", past_the_front,
     "experiments/planted.py:1 imports megatrain.planner.long_context_plan, not in its __all__"),
    ("megatrain/commands/planted.py", "from ..planner.summary import first_screen\n", past_the_front,
     "megatrain/commands/planted.py:1 imports megatrain.planner.summary"),
    ("megatrain/commands/planted.py", "import megatrain.planner.multi\n", past_the_front,
     "megatrain/commands/planted.py:1 imports megatrain.planner.multi"),
    ("megatrain/metrics/planted.py", "def f():\n    from ..planner.step_time import layer_flops\n", past_the_front,
     "megatrain/metrics/planted.py:2 imports megatrain.planner.step_time"),
    ("megatrain/planner/planted.py", "def f():\n    from ..commands.plan import run_sweep\n", planner_on_commands,
     "megatrain/planner/planted.py:2 imports megatrain.commands.plan"),
])
def test_a_planted_import_is_caught(tmp_path, where, planted, check, expect):
    root = copy_of_the_tree(tmp_path)
    (root / where).write_text(planted)
    bad = check(root)
    assert expect in bad and all(where in b for b in bad), bad
