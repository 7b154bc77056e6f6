"""The engine's wings import downwards only, and the code outside the engine uses its public API.

The order is written here once (docs/DESIGN.md draws it): a wing may import its own modules and the wings
below it, never one above; the engine's top (engine.py, accounting.py) may import every wing, and no wing
imports the top. Outside the engine, only `megatrain.engine` itself (the names in its `__all__`) may be
imported. Imports are read from the source (lazy ones inside functions included), so nothing is executed.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "megatrain" / "engine"
ORDER = ["runtime", "host", "layer", "pipeline", "update", "parallel", "model"]
TOP = len(ORDER)


def _absolute(module: Path, node: ast.ImportFrom, root: Path | None = None) -> str:
    if node.level == 0:
        return node.module or ""
    package = list(module.relative_to(root or ROOT).with_suffix("").parts)
    package = package[: len(package) - node.level]  # a module's package is its path less its own name
    return ".".join(package + ([node.module] if node.module else []))


def copy_of_the_tree(tmp_path: Path, folders: tuple[str, ...] = ("megatrain", "experiments", "baselines")) -> Path:
    """The checkout's `folders` under `tmp_path`, to plant an import in (the planted-import controls)."""
    for folder in folders:
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def imports_of(module: Path, root: Path | None = None) -> list[tuple[int, str]]:
    """(line, absolute target) for every import in a module; `from pkg import name` yields pkg.name too."""
    found = []
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, node, root)
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return found


def rank(target: str) -> int | None:
    """A target's place in the order, or None when it is not inside the engine's wings or top."""
    parts = target.split(".")
    if parts[:2] != ["megatrain", "engine"] or len(parts) < 3:
        return None
    if parts[2] in ORDER:
        return ORDER.index(parts[2])
    if (ENGINE / f"{parts[2]}.py").exists():
        return TOP
    return None


def upward_imports() -> list[str]:
    bad = []
    for module in sorted(ENGINE.rglob("*.py")):
        parts = module.relative_to(ENGINE).parts
        if len(parts) == 1:
            continue  # the top and the package itself import every wing
        own = ORDER.index(parts[0])
        for line, target in imports_of(module):
            r = rank(target)
            if r is not None and r > own:
                bad.append(f"{module.relative_to(ROOT)}:{line} imports {target}")
    return bad


def private_reaches() -> list[str]:
    """Imports of engine modules from outside the engine (the public API is `megatrain.engine` alone)."""
    bad = []
    for module in sorted((ROOT / "megatrain").rglob("*.py")):
        if ENGINE in module.parents:
            continue
        for line, target in imports_of(module):
            if target.startswith("megatrain.engine.") and rank(target) is not None:
                bad.append(f"{module.relative_to(ROOT)}:{line} imports {target}")
    return bad


def test_every_wing_is_in_the_order():
    wings = {p.name for p in ENGINE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert wings == set(ORDER)


def test_at_most_twelve_modules_at_the_engines_top():
    assert len(list(ENGINE.glob("*.py"))) <= 12


def test_the_wings_import_downwards_only():
    assert upward_imports() == []


def test_code_outside_the_engine_uses_its_public_api():
    assert private_reaches() == []


@pytest.mark.parametrize("planted", ["from ..model.placement import resolve_device\n",
                                     "def f():\n    from megatrain.engine.engine import Engine\n"])
def test_a_planted_upward_import_is_caught(tmp_path, planted, monkeypatch):
    # the check's own control: a copy of the engine with one upward import planted in its lowest wing
    copy = tmp_path / "megatrain" / "engine"
    shutil.copytree(ENGINE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "runtime" / "planted.py").write_text(planted)
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    monkeypatch.setitem(globals(), "ENGINE", copy)
    bad = upward_imports()
    assert bad and all(b.startswith("megatrain/engine/runtime/planted.py:") for b in bad)


def test_a_planted_private_reach_is_caught(tmp_path, monkeypatch):
    copy = tmp_path / "megatrain"
    shutil.copytree(ROOT / "megatrain", copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "planted_face.py").write_text("from .engine.host.store import HostStore\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    monkeypatch.setitem(globals(), "ENGINE", copy / "engine")
    assert [b for b in private_reaches() if "planted" in b] == ["megatrain/planted_face.py:1 imports megatrain.engine.host.store",
                                 "megatrain/planted_face.py:1 imports megatrain.engine.host.store.HostStore"]


def test_the_public_api_is_what_it_lists():
    import megatrain.engine as engine

    assert sorted(engine.__all__) == sorted(engine._HOME)
    for name in engine.__all__:
        assert getattr(engine, name) is not None
