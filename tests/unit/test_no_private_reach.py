"""No code outside megatrain/engine touches a private attribute of an engine or a backend.

The faces, the CLI and the harness talk to the engine and to backends through their public methods only
(docs/ENGINE_API.md): a private attribute read or written from outside (`eng._norm = None`,
`getattr(eng, "_layered", None)`, `backend._config_clip = ...`) is a dependency nobody sees when the engine
changes. An engine or backend is recognised by the name it is held under (`eng`, `engine`, `backend`,
`self.engine`, `earlier.backend`, `ds_engine`, ...); any private attribute reached through such a name counts,
directly or through getattr / hasattr / setattr / delattr with a literal name.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "megatrain"
ENGINE = ROOT / "engine"
# A name an engine or backend object is held under: eng, engine, backend, ds_engine, _backend, engines ...
HOLDER = re.compile(r"^_?([a-z0-9]+_)*(eng|engine|backend)s?$")
ATTR_FUNCS = {"getattr", "hasattr", "setattr", "delattr"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _chain(node: ast.expr) -> list[str] | None:
    """`a.b.c` as ["a", "b", "c"]; None when the expression is not a plain dotted name."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return parts[::-1]


def _held(node: ast.expr) -> bool:
    chain = _chain(node)
    return chain is not None and any(HOLDER.match(part) for part in chain)


def reaches(source: str, filename: str = "<source>") -> list[str]:
    """Every private attribute of an engine or backend that `source` touches, as 'file:line: expression'."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Attribute) and _private(node.attr) and _held(node.value):
            found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ATTR_FUNCS
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and _private(node.args[1].value) and _held(node.args[0])):
            found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
    return found


def _outside_engine() -> list[Path]:
    return [p for p in sorted(ROOT.rglob("*.py")) if ENGINE not in p.parents]


def test_scan_covers_the_faces() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in _outside_engine()}
    assert {"backend/__init__.py", "deepspeed/initializer.py", "integrations/engine_reuse.py"} <= names
    assert not any(n.startswith("engine/") for n in names)


def test_no_module_outside_the_engine_reaches_a_private_attribute() -> None:
    found = [hit for p in _outside_engine() for hit in reaches(p.read_text(), p.relative_to(ROOT).as_posix())]
    assert not found, ("private engine/backend attributes touched outside megatrain/engine (use or add a public "
                       "method, docs/ENGINE_API.md):\n" + "\n".join(found))


# What the faces did before the public API (each line taken from them), and variants of the same reach.
PLANTED = [
    'if getattr(eng, "_layered", None) is not None:\n    pass',
    'before = getattr(eng, "_name_of", {})',
    "eng._norm = None",
    "backend._config_clip = float(cfg.gradient_clipping)",
    "opt = backend._exact(client(groups))",
    "self.engine._layered.stream.stall_s = 0.1",
    "earlier.backend.engine._aliases",
    "hasattr(self.backend, '_clipped')",
    "setattr(ds_engine, '_config', None)",
]


@pytest.mark.parametrize("line", PLANTED)
def test_planted_reach_is_found(line: str) -> None:
    assert len(reaches(line)) == 1, line


@pytest.mark.parametrize("line", [
    "self._clipped = False",  # an object's own private state
    "eng.grads_written()",  # the public API
    "backend.set_clipping(1.0)",
    "x = engine.__class__",  # dunders are not private
    'getattr(engine, "dp", None)',
    "self._schedulers.append(s)",
    "model._tied_weights_keys",  # not an engine or a backend
])
def test_public_or_own_access_is_not_flagged(line: str) -> None:
    assert reaches(line) == [], line


def test_planted_line_in_a_face_fails_the_scan() -> None:
    """The scan run over a copy of a face with one old line put back finds exactly that line."""
    face = (ROOT / "backend" / "__init__.py").read_text()
    planted = face + "\n\ndef _old(eng):\n    eng._norm = None\n"
    assert reaches(face) == []
    assert [h.split(": ", 1)[1] for h in reaches(planted)] == ["eng._norm"]

