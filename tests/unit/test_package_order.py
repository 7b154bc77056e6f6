"""The package diagram, as a test: every part of `megatrain/` sits in one tier and imports only its own tier and the
tiers below it; the engine and the planner sit side by side and never import each other; the harness
(`experiments/`, `baselines/`) reaches the engine through `megatrain.engine`'s exported names only.

docs/DESIGN.md draws the same tiers. Imports are read from the source (lazy ones inside functions included), so
nothing is executed. A `__main__.py` is an entry point (`python -m ...`), not a library module: it is not checked.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_layering import copy_of_the_tree, imports_of

ROOT = Path(__file__).resolve().parents[2]

# Top to bottom. A part is a package or module directly under megatrain/, or a module of the config package: the
# config's typed contract (schema, validate) sits below the engine, which takes a resolved EngineConfig; reading
# and resolving a config sits above it.
TIERS: list[tuple[str, set[str]]] = [
    ("faces, integrations, commands", {"accelerate", "deepspeed", "integrations", "commands"}),
    ("backend, run state, measurements", {"backend", "run", "metrics"}),
    ("reading a config", {"config.resolve", "config.settings", "config.deepspeed"}),
    ("engine | planner", {"engine", "planner"}),
    ("the settings' contract", {"config", "config.schema", "config.validate", "config.settle"}),
    ("costs, models, files", {"costs", "models", "files", "lr_schedules", "_startup"}),
]
APART = {("engine", "planner"), ("planner", "engine")}  # same tier, never importing each other


def part_of(module: str, root: Path | None = None) -> str | None:
    """The diagram's part a dotted `megatrain...` name belongs to, or None for `megatrain` itself / outside it."""
    root = root or ROOT
    parts = module.split(".")
    if parts[0] != "megatrain" or len(parts) < 2:
        return None
    if parts[1] == "config":
        sub = f"config.{parts[2]}" if len(parts) > 2 else "config"
        if (root / "megatrain" / "config" / f"{parts[2] if len(parts) > 2 else ''}.py").exists():
            return sub
        return "config"  # a name imported from the package itself
    return parts[1]


def tier_of(part: str) -> int | None:
    return next((i for i, (_, members) in enumerate(TIERS) if part in members), None)


def library_modules(root: Path) -> list[Path]:
    return [p for p in sorted((root / "megatrain").rglob("*.py"))
            if p.name != "__main__.py" and p != root / "megatrain" / "__init__.py"]


def unplaced(root: Path = ROOT) -> list[str]:
    parts = {part_of(".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"), root)
             for p in library_modules(root)}
    return sorted(p for p in parts if p is not None and tier_of(p) is None)


def wrong_way(root: Path = ROOT) -> list[str]:
    bad = []
    for path in library_modules(root):
        own = part_of(".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__"), root)
        for line, target in imports_of(path, root):
            other = part_of(target, root)
            if other is None or other == own or tier_of(other) is None or tier_of(own) is None:
                continue
            if tier_of(other) < tier_of(own) or (own, other) in APART:
                bad.append(f"{path.relative_to(root)}:{line} ({own}) imports {target} ({other})")
    return bad


def harness_reaches(root: Path = ROOT) -> list[str]:
    """Imports of `megatrain.engine.<module>` from the harness (the engine's API is `megatrain.engine` alone)."""
    bad = []
    for folder in ("experiments", "baselines"):
        for path in sorted((root / folder).rglob("*.py")):
            for line, target in imports_of(path, root):
                if target.startswith("megatrain.engine.") and not _exported(target):
                    bad.append(f"{path.relative_to(root)}:{line} imports {target}")
    return bad


def _exported(target: str) -> bool:
    import megatrain.engine as engine

    head, _, tail = target.removeprefix("megatrain.engine.").partition(".")
    if head not in engine.__all__:
        return False
    return not tail or tail in getattr(getattr(engine, head), "__all__", ())


def test_every_part_is_in_a_tier():
    assert unplaced() == []


def test_at_most_twelve_modules_at_the_top():
    assert len(list((ROOT / "megatrain").glob("*.py"))) <= 12


def test_parts_import_their_tier_and_below_only():
    assert wrong_way() == []


def test_the_harness_uses_the_engines_exported_names():
    assert harness_reaches() == []



@pytest.mark.parametrize(("where", "planted", "expect"), [
    ("megatrain/costs/planted.py", "from ..config.resolve import resolve\n", "(costs) imports megatrain.config.resolve"),
    ("megatrain/engine/runtime/planted.py", "def f():\n    from megatrain.planner import plan\n",
     "(engine) imports megatrain.planner"),
    ("megatrain/planner/planted.py", "from ..engine import Engine\n", "(planner) imports megatrain.engine"),
    ("megatrain/config/validate.py", "from ..backend import Backend\n", "imports megatrain.backend (backend)"),
])
def test_a_planted_upward_or_sideways_import_is_caught(tmp_path, where, planted, expect):
    root = copy_of_the_tree(tmp_path)
    (root / where).write_text(planted)
    bad = wrong_way(root)
    assert bad and all(where in b for b in bad) and any(expect in b for b in bad), bad


def test_a_planted_private_reach_from_the_harness_is_caught(tmp_path):
    root = copy_of_the_tree(tmp_path)
    (root / "experiments" / "planted.py").write_text("from megatrain.engine.host.store import FlatGroup\n")
    assert [b for b in harness_reaches(root) if "planted" in b][:1] == [
        "experiments/planted.py:1 imports megatrain.engine.host.store"]


def test_a_new_part_outside_the_diagram_is_caught(tmp_path):
    root = copy_of_the_tree(tmp_path)
    (root / "megatrain" / "newpart").mkdir()
    (root / "megatrain" / "newpart" / "__init__.py").write_text("")
    assert unplaced(root) == ["newpart"]
