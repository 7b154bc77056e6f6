"""The update path gets what it runs with when it is built (the ranks' verdict, the NVMe tier): nothing is set on
it, or on its optimizer thread, after construction."""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import torch
from conftest import tiny_model

from megatrain.config.schema import EngineConfig
from megatrain.engine import Engine
from megatrain.engine.update.choose import choose
from megatrain.engine.update.update import InBackward

ENGINE = Path(__file__).resolve().parents[2] / "megatrain" / "engine"


def _engine(**cfg) -> Engine:
    return Engine(copy.deepcopy(tiny_model(layers=2, hidden=32, vocab=128)),
                  EngineConfig(device="cpu", compute_dtype="float32", parity_probe=False, **cfg),
                  optimizer=lambda named: torch.optim.AdamW([p for _, p in named], lr=1e-2))


def test_the_nvme_tier_is_the_update_paths_own(tmp_path):
    eng = _engine(nvme_path=str(tmp_path))
    assert eng.spill is not None and eng.update.spill is eng.spill
    assert "spill" not in vars(eng.update.layered)  # not hung on the optimizer thread's object
    eng.spill.close()


def test_the_ranks_verdict_is_given_to_the_in_backward_path():
    eng = _engine(optimizer_in_backward=True)
    assert isinstance(eng.update, InBackward) and not eng.update.data_parallel  # one rank: its own verdict
    assert eng.update.agree(3, "a layer failed") == 3

    def verdict(value: int, what: str) -> int:
        return value

    path = choose(eng.optimizer, eng.store, eng.events, eng.config, eng.trace_log, agree=verdict)
    assert isinstance(path, InBackward) and path.agree is verdict and path.data_parallel


def _assigned_attributes(path: Path) -> list[str]:
    """Every `a.b.c = ...` target in `path`, written out."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign | ast.AugAssign) else []
        for t in targets:
            for e in t.elts if isinstance(t, ast.Tuple) else [t]:
                if isinstance(e, ast.Attribute):
                    out.append(ast.unparse(e))
    return out


def test_nothing_is_poked_into_the_update_path_after_construction():
    # Its optimizer is replaced through Engine.replace_optimizer (a face's prepare(optimizer)): not wiring.
    poked = [a for a in _assigned_attributes(ENGINE / "engine.py")
             if a.startswith("self.update.") and a != "self.update.optimizer"]
    assert poked == [], f"engine.py sets the update path's {poked}: pass them to update.choose instead"
    spilled = [a for a in _assigned_attributes(ENGINE / "host" / "spill.py") if a.endswith(".spill")]
    assert spilled == [], f"spill.py sets {spilled}: the update path builds its spill (spill_for)"
