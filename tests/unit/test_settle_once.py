"""One resolve pass: the engine's "auto" is settled in megatrain/config/ (settle.py's settle_engine) once per engine
build, whichever face builds it, and no module outside the config package compares a setting with "auto" but the
per-batch rules' own."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

import megatrain
from megatrain.accelerate import Accelerator
from megatrain.backend import MegatrainBackend
from megatrain.config import resolve as resolve_module
from megatrain.config import settle
from megatrain.config.schema import IF_FITS, EngineConfig, EnginePlan
from megatrain.config.settle import LATER, LAYERED, WHOLE, EngineFacts, settle_engine
from megatrain.engine import Engine

ROOT = Path(__file__).resolve().parents[2]

# Outside megatrain/config/, the one module that parses a word "auto": the residency setting's parser, where AUTO
# is defined (costs/residency.py; config/ sits above costs/ and re-exports it). The per-batch rules (costs/memory.py)
# tell a setting from "auto" by its type.
ALLOWED = {"megatrain/costs/residency.py"}


def _is_auto(node: ast.AST) -> bool:
    """The word itself, or the AUTO constant under any module's name."""
    if isinstance(node, ast.Constant):
        return node.value == "auto"
    if isinstance(node, ast.Name):
        return node.id == "AUTO"
    if isinstance(node, ast.Attribute):
        return node.attr == "AUTO"
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_auto(e) for e in node.elts)
    return False


def modules_comparing_auto(package: Path) -> set[str]:
    """The modules under `package`, outside its config/ package, with a comparison (==, !=, in, is) one of whose
    operands is "auto" (an environment variable's default inside a call is not an operand: not a setting)."""
    found = set()
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent).as_posix()
        if rel.startswith(f"{package.name}/config/"):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        if any(isinstance(n, ast.Compare) and any(_is_auto(o) for o in (n.left, *n.comparators)) for n in ast.walk(tree)):
            found.add(rel)
    return found


def test_auto_is_compared_with_a_setting_in_at_most_two_modules_outside_config():
    found = modules_comparing_auto(ROOT / "megatrain")
    assert len(ALLOWED) <= 2
    assert found == ALLOWED, f"compare through megatrain/config (left_auto, EngineConfig): {found - ALLOWED}"


def test_the_scan_sees_a_planted_comparison(tmp_path):
    # Control: the forms a comparison takes are each counted; the config package, an environment default and a
    # message are not.
    pkg = tmp_path / "megatrain"
    (pkg / "config").mkdir(parents=True)
    (pkg / "config" / "schema.py").write_text('AUTO = "auto"\ndef left_auto(v):\n    return v == AUTO\n')
    (pkg / "word.py").write_text('def f(c):\n    return c.overlap == "auto"\n')
    (pkg / "named.py").write_text('from .config import schema\ndef f(c):\n    return c.x is not schema.AUTO\n')
    (pkg / "member.py").write_text('def f(v):\n    return v in (True, False, "auto")\n')
    (pkg / "env.py").write_text('import os\nON = os.environ.get("K", "auto") != "torch"\n')
    (pkg / "message.py").write_text('E = "use \'auto\'"\n')
    assert modules_comparing_auto(pkg) == {"megatrain/word.py", "megatrain/named.py", "megatrain/member.py"}


@pytest.mark.parametrize("device,optimizer,overlap,speculative,pin", [
    ("cuda", LAYERED, True, IF_FITS, True),
    ("cuda", WHOLE, False, False, True),  # steps whole: nothing to overlap or speculate with
    ("cuda", LATER, False, False, True),  # views of the optimizer would be built before it is handed over
    ("cpu", LAYERED, False, False, False),  # the host update shares the cores with the "device"
])
def test_settle_engine_rules(device, optimizer, overlap, speculative, pin):
    cfg, off = settle_engine(EngineConfig(device="cpu"), EngineFacts(device, optimizer))
    assert (cfg.optimizer_overlap, cfg.speculative_step, cfg.pin_memory, off) == (overlap, speculative, pin, ())
    assert isinstance(cfg, EnginePlan)  # settled is a type, not a stage
    assert cfg.written["optimizer_overlap"] is None and cfg.written["speculative_step"] == "auto"  # as written


def test_settle_engine_keeps_what_was_set_and_settles_once():
    cfg = EngineConfig(device="cpu", optimizer_overlap=True, speculative_step=False, pin_memory=True)
    settled, off = settle_engine(cfg, EngineFacts("cpu"))
    assert (settled.optimizer_overlap, settled.speculative_step, settled.pin_memory, off) == (True, False, True, ())
    assert settle_engine(settled, EngineFacts("cuda"))[0] is settled  # settled already: as it is
    # A face's config asks for pinning by habit: off without CUDA, and said.
    habit, off = settle_engine(cfg, EngineFacts("cpu", pin_by_habit=True))
    assert habit.pin_memory is False and off == ("pin_memory (no CUDA device)",)
    assert settle_engine(EngineConfig(device="cpu", optimizer_in_backward=True), EngineFacts("cuda"))[0] \
        .speculative_step is False
    assert settle_engine(EngineConfig(device="cpu", nvme_path="/x"), EngineFacts("cuda"))[0].speculative_step is False
    with pytest.raises(ValueError, match="optimizer='adam'"):
        EngineFacts("cuda", "adam")
    with pytest.raises(ValueError, match="speculative_step='if it fits'"):
        EngineConfig(speculative_step=IF_FITS)  # the settled value is not a setting to write


@pytest.fixture
def counted(monkeypatch):
    """Calls of the face step (config/resolve.py resolve) and the engine step (settle_engine), under every name a
    loaded module imported them by."""
    calls = {"resolve": 0, "settle_engine": 0}
    for name, fn in (("resolve", resolve_module.resolve), ("settle_engine", settle.settle_engine)):
        def spy(*a, _fn=fn, _name=name, **k):
            calls[_name] += 1
            return _fn(*a, **k)

        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").startswith("megatrain") and getattr(mod, name, None) is fn:
                monkeypatch.setattr(mod, name, spy)
    return calls


ON_CPU = {"device": "cpu", "parity_probe": False}


def _model():
    return tiny_model(layers=1, hidden=32, vocab=128)


def _accelerate():
    model = _model()
    acc = Accelerator(config={"megatrain": ON_CPU})
    acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    return acc.backend.engine


def _deepspeed():
    engine, *_ = megatrain.initialize(model=_model(), config={"train_micro_batch_size_per_gpu": 1,
                                                              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                                              "megatrain": ON_CPU})
    return engine.engine


def _engine():
    return Engine(_model(), EngineConfig(**ON_CPU))


def _backend():
    backend = MegatrainBackend(config={"megatrain": ON_CPU})
    backend.prepare(_model(), None)
    return backend.engine


@pytest.mark.parametrize("build,resolves", [(_accelerate, 1), (_deepspeed, 1), (_engine, 0), (_backend, 1)],
                         ids=["accelerate", "deepspeed", "engine", "backend"])
def test_each_face_resolves_once_per_engine_build(counted, build, resolves):
    eng = build()
    assert counted == {"resolve": resolves, "settle_engine": 1}
    assert isinstance(eng.config, EnginePlan)
    assert isinstance(eng.config.optimizer_overlap, bool) and isinstance(eng.config.pin_memory, bool)


def test_a_config_not_typed_resolved_is_resolved_again(counted, monkeypatch):
    # Control: where the type that says a step ran is lost (the face's resolve hands back the settings as written),
    # the backend resolves again, and the count says so.
    resolved = resolve_module._resolved
    monkeypatch.setattr(resolve_module, "_resolved", lambda ec: ec if ec is None else resolved(ec).as_type(EngineConfig))
    _accelerate()
    assert counted == {"resolve": 2, "settle_engine": 1}


def test_the_settled_types_compare_by_their_settings():
    written = EngineConfig(device="cpu", optimizer_overlap=False, speculative_step=False, pin_memory=False)
    plan, _ = settle_engine(written, EngineFacts("cpu"))
    assert type(plan) is EnginePlan and plan == written and hash(plan) == hash(written)
    assert plan.written == written.written and type(plan.rewrite()) is EngineConfig  # rewritten: as written again
    # Control: a setting that differs makes them differ, whatever the type
    assert settle_engine(EngineConfig(device="cpu", optimizer_overlap=False, speculative_step=False),
                         EngineFacts("cuda"))[0] != written  # pinned on CUDA
