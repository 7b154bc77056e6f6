"""Part of a model through the launchers and trainers users run: HF Trainer with the embedding frozen, and two ranks
under torchrun (tests/workers/frozen_trainer.py, tests/workers/frozen_dp_worker.py)."""

from __future__ import annotations

import json
from pathlib import Path

from kit import run_python, worker_env

ROOT = Path(__file__).resolve().parents[2]
WORKERS = ROOT / "tests" / "workers"
TOL = 1e-5


def _report(out: str) -> dict:
    line = next(ln for ln in out.splitlines() if ln.startswith("REPORT "))
    return json.loads(line[len("REPORT "):])


def test_hf_trainer_with_the_embedding_frozen_trains_as_plain_pytorch(tmp_path):
    out = run_python([WORKERS / "frozen_trainer.py", tmp_path], cwd=tmp_path,
                     env=worker_env(world_size=1, threads=2), timeout=600, check=True).stdout
    r = _report(out)
    plain, mine = r["plain"], r["megatrain"]
    assert mine["engine"] == "MegaTrainEngine" and plain["engine"] != "MegaTrainEngine"
    assert len(mine["losses"]) == len(plain["losses"]) == 5
    assert max(abs(a - b) for a, b in zip(mine["losses"], plain["losses"])) <= TOL
    assert all(abs(a - b) <= TOL * b for a, b in zip(mine["grad_norms"], plain["grad_norms"])), r
    assert min(plain["grad_norms"]) > 1.0  # control: every step's clip bites
    assert not mine["embedding_moved"] and not plain["embedding_moved"]
    assert mine["frozen_flags"] == plain["frozen_flags"] == ["model.embed_tokens.weight"]
