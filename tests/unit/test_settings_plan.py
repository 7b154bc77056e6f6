"""Settings as written and a plan as settled: "auto" is one word defined once, only megatrain/config/ asks whether a
setting is still left to it, and the engine takes its plan once (`Engine.__init__` assigns `self.config` once).
Read from the source by ast, nothing executed; each scan has a planted control."""

from __future__ import annotations

import ast
from pathlib import Path

from test_layering import copy_of_the_tree

ROOT = Path(__file__).resolve().parents[2]

# The questions "is this setting still auto?" and the config's internal stages: megatrain/config/ answers them, and
# its plan (an EnginePlan) carries the answers as types and values.
ASKS = {"left_auto", "host_mode_open", "IF_FITS", "SETTLED", "FACE_RESOLVED", "WRITTEN"}


def definitions_of_auto(package: Path) -> list[str]:
    """The modules (and lines) under `package` that bind the name AUTO by assignment (an import is not one)."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AnnAssign, ast.AugAssign)) else []
            names = [n for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
            if any(n.id == "AUTO" for n in names):
                found.append(f"{path.relative_to(package.parent).as_posix()}:{node.lineno}")
    return found


def askers(package: Path) -> dict[str, set[str]]:
    """The modules under `package` outside its config/ package that name one of ASKS (imported, called, read as an
    attribute), with the names they use."""
    found: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent).as_posix()
        if rel.startswith(f"{package.name}/config/"):
            continue
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Name) and node.id in ASKS:
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and node.attr in ASKS:
                names.add(node.attr)
            elif isinstance(node, ast.alias) and node.name in ASKS:
                names.add(node.name)
        if names:
            found[rel] = names
    return found


def config_assignments(path: Path, cls: str = "Engine", attr: str = "config") -> list[int]:
    """The lines of `cls.__init__` in `path` that assign `self.<attr>` (chained and tuple targets included)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    init = next(f for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name == cls
                for f in c.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    lines = []
    for node in ast.walk(init):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
        for t in targets:
            for n in ast.walk(t):
                if (isinstance(n, ast.Attribute) and n.attr == attr and isinstance(n.value, ast.Name)
                        and n.value.id == "self"):
                    lines.append(node.lineno)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value == attr):
            lines.append(node.lineno)
    return lines


def test_auto_is_defined_once():
    found = definitions_of_auto(ROOT / "megatrain")
    assert [f.split(":")[0] for f in found] == ["megatrain/costs/residency.py"], found


def test_a_second_definition_of_auto_is_seen(tmp_path):
    root = copy_of_the_tree(tmp_path, ("megatrain",))
    planted = root / "megatrain" / "costs" / "host_mode.py"
    planted.write_text(planted.read_text() + '\nAUTO: str = "auto"\n')
    assert len(definitions_of_auto(root / "megatrain")) == 2


def test_no_module_outside_config_asks_whether_a_setting_is_still_auto():
    assert askers(ROOT / "megatrain") == {}


def test_an_asking_module_is_seen(tmp_path):
    pkg = tmp_path / "megatrain"
    (pkg / "config").mkdir(parents=True)
    (pkg / "config" / "schema.py").write_text('def left_auto(v):\n    return v == "auto"\n')
    (pkg / "called.py").write_text("from .config.schema import left_auto\ndef f(c):\n    return left_auto(c.x)\n")
    (pkg / "prop.py").write_text("def f(c):\n    return c.host_mode_open\n")
    (pkg / "word.py").write_text("from .config import schema\nX = schema.IF_FITS\n")
    (pkg / "plain.py").write_text("def f(c):\n    return c.host_master\n")
    assert askers(pkg) == {"megatrain/called.py": {"left_auto"}, "megatrain/prop.py": {"host_mode_open"},
                           "megatrain/word.py": {"IF_FITS"}}


def test_the_engine_assigns_its_config_once():
    assert len(config_assignments(ROOT / "megatrain" / "engine" / "engine.py")) == 1


def test_a_second_config_assignment_is_seen(tmp_path):
    path = tmp_path / "engine.py"
    path.write_text("class Engine:\n    def __init__(self, c):\n        self.config = config = c\n"
                    "        if c:\n            self.config, x = c, 1\n        setattr(self, 'config', c)\n"
                    "    def other(self):\n        self.config = None\n")
    assert config_assignments(path) == [3, 5, 6]


def test_the_start_line_prints_the_plan():
    from conftest import tiny_model

    from megatrain.config.schema import EngineConfig, EnginePlan
    from megatrain.engine import Engine
    from megatrain.run.start_line import describe

    eng = Engine(tiny_model(layers=1, hidden=32, vocab=128), EngineConfig(device="cpu", parity_probe=False))
    assert isinstance(eng.config, EnginePlan)
    plan = describe("accelerate", eng).split(" | plan: ")[1]
    # a CPU device: nothing pinned, the update in step(), no speculation; the per-batch rules named
    assert plan == ("pageable host memory, update in step(), no speculative step, per batch: residency, "
                    "offload_activations, mlp_tile_tokens, loss_chunk_tokens, segment_attention")
    # Control: what is set is no longer left to a rule per batch, and a choice written is printed as made
    set_ = Engine(tiny_model(layers=1, hidden=32, vocab=128),
                  EngineConfig(device="cpu", parity_probe=False, residency="stream", mlp_tile_tokens=None,
                               optimizer_overlap=True))
    plan = describe("accelerate", set_).split(" | plan: ")[1]
    assert plan == ("pageable host memory, update overlapped with the next forward, no speculative step, per batch: "
                    "offload_activations, loss_chunk_tokens, segment_attention")
