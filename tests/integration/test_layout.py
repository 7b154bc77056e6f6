"""The house rules that keep the code easy to see and to change, measured: no import cycles among megatrain/,
baselines/ and experiments/ (every import counts, inside functions and TYPE_CHECKING blocks too), no module in
megatrain/ much over 700 lines, the cost models importable without torch, a README a newcomer reads in minutes."""

from __future__ import annotations

import ast
from pathlib import Path

from kit import run_python

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("megatrain", "baselines", "experiments")
MAX_LINES = 720
README_CHARS = 12_000


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for top in PACKAGES:
        for p in (ROOT / top).rglob("*.py"):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_pkg else parts)] = (p, is_pkg)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (`from a import b` counts a.b when b is a module, else a)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, (path, is_pkg) in mods.items():
        pkg = mod if is_pkg else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for name in names:
                while name and name not in mods:
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    graph[mod].add(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_sees_a_lazy_import_cycle():
    # Control: two modules importing each other, one of them inside a function, are found.
    graph = import_graph()
    graph["megatrain.costs.pinning"].add("megatrain.costs.pipeline")
    graph["megatrain.costs.pipeline"].add("megatrain.costs.pinning")
    assert any({"megatrain.costs.pinning", "megatrain.costs.pipeline"} <= set(c) for c in cycles(graph))


def test_no_module_in_megatrain_is_much_over_700_lines():
    sizes = {m: len(p.read_text().splitlines()) for m, (p, _) in _modules().items() if m.startswith("megatrain")}
    assert len(sizes) > 50
    assert {m: n for m, n in sizes.items() if n > MAX_LINES} == {}


def test_the_cost_models_import_without_torch():
    code = ("import sys, builtins; real = builtins.__import__\n"
            "def guard(name, *a, **k):\n"
            "    assert not name.startswith('torch'), name\n"
            "    return real(name, *a, **k)\n"
            "builtins.__import__ = guard\n"
            "import megatrain.costs.memory, megatrain.costs.modes, megatrain.costs.pinning, megatrain.costs.pipeline\n"
            "print('ok')")
    r = run_python(["-c", code], timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_the_readme_is_short_and_its_first_screen_shows_what_a_newcomer_needs():
    text = (ROOT / "README.md").read_text()
    assert len(text) <= README_CHARS, len(text)
    first = "\n".join(text.splitlines()[:80])
    for needed in ("bash scripts/setup.sh test && .venv/bin/python -m pytest -q", "import megatrain as deepspeed",
                   "Accelerator(backend=", "megatrain plan", "five files",
                   "megatrain train --config"):
        assert needed in first, needed
    # The test command CI runs is the README's, verbatim.
    assert "bash scripts/setup.sh test && .venv/bin/python -m pytest -q" in (ROOT / ".ci" / "run").read_text()
