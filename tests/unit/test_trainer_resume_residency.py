"""`megatrain train` (Hugging Face Trainer's DeepSpeed road) resumed from a checkpoint places the optimizer-resident
layer count its run chose, not what this device's free memory would choose now (integrations/resume_residency.py).

Emulated: a CPU device under two device budgets, one where "auto" puts both of the example model's layers' optimizer
on the device (32 MiB) and one where it puts one (24 MiB): the run is resumed under the second. (On a CPU device the
device's update is the host's own function, so the bits agree whatever the count: what is checked is the count
placed, said on the start line, the faces' warning not given, and that the resumed run ends on the uninterrupted
run's weights bit for bit.)"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from kit import bits
from safetensors.torch import load_file

from megatrain.backend.placement import advice_for
from megatrain.commands import sft
from megatrain.config import EngineConfig
from megatrain.integrations import resume_residency
from megatrain.run import train_state

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "sft" / "sft.yaml"
BOTH, ONE = 32 << 20, 24 << 20  # budgets under which "auto" places 2 and 1 layers' optimizer on the device


def _train(out: Path, budget: int, resume_from: Path | None = None) -> dict:
    run = sft.load_run(EXAMPLE, [f"output_dir={out}", "report=null", "max_steps=4", "save_steps=2",
                                 "eval_data=null", "megatrain.compute_dtype=float32",
                                 f"megatrain.device_budget_bytes={budget}"])
    return sft.train(run, resume_from=resume_from)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("whole") / "run"
    _train(out, BOTH)
    return out


def _resumed(tmp_path: Path, uninterrupted: Path, capfd) -> tuple[str, list[str], dict[str, torch.Tensor]]:
    out = tmp_path / "resumed"
    out.mkdir()
    shutil.copytree(uninterrupted / "checkpoint-2", out / "checkpoint-2")
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(out, ONE, resume_from=out / "checkpoint-2")
    err = capfd.readouterr().err
    line = next(s for s in err.splitlines() if "MegaTrain is training" in s)
    return line, [str(w.message) for w in caught], load_file(out / "final" / "model.safetensors")


def test_the_checkpoint_holds_the_count_its_run_chose(uninterrupted):
    record = resume_residency.checkpoint_record(uninterrupted / "checkpoint-2")
    assert record is not None and record["optimizer_layers"] == 2 and record["layers"] == 2
    assert resume_residency.checkpoint_record(uninterrupted) is None  # not a checkpoint folder


def test_a_resume_places_the_runs_count_and_trains_its_bits(tmp_path, uninterrupted, capfd):
    line, said, got = _resumed(tmp_path, uninterrupted, capfd)
    assert "2 layers' optimizer on the device (from checkpoint)" in line, line
    assert not [s for s in said if "layers on its device, this engine" in s], said
    want = load_file(uninterrupted / "final" / "model.safetensors")
    assert got.keys() == want.keys()
    assert all(torch.equal(bits(got[k]), bits(want[k])) for k in want)


def test_negative_control_without_it_the_resume_chooses_from_this_device(tmp_path, uninterrupted, capfd,
                                                                         monkeypatch):
    monkeypatch.setattr(resume_residency, "install", lambda: None)
    resume_residency.uninstall()
    line, said, _ = _resumed(tmp_path, uninterrupted, capfd)
    assert "1 layers' optimizer on the device (chosen)" in line, line
    assert any("updated 2 layers on its device, this engine 1" in s for s in said), said


def _advised(model: torch.nn.Module, config: EngineConfig | None = None) -> int | None:
    """The optimizer-resident count the backend's advisor for an engine over `model` places from a checkpoint
    (None: no checkpoint's count; a CPU device has no planner advisor of its own)."""
    a = advice_for(torch.device("cpu"), model, config or EngineConfig())
    return a.optimizer if isinstance(a, train_state.CheckpointResidency) else None


def test_resuming_leaves_counts_the_user_set_alone():
    trainer = SimpleNamespace(model=torch.nn.Linear(2, 2), model_init=None)
    with resume_residency.resuming(trainer, {"optimizer_layers": 2}):
        assert _advised(trainer.model) == 2
        assert advice_for(torch.device("cpu"), trainer.model, EngineConfig(residency={"weights": 1})) is None
    assert _advised(trainer.model) is None  # carried while the run lasts only


def test_two_resumed_runs_in_one_process_each_place_their_own_count():
    """Two Trainer runs resuming at once in one process (two threads' runs, the first to end not the last begun):
    each model's engine places its own checkpoint's count, a model not resumed none, and one run's end leaves the
    other's in place. Failed with the advisor swapped in a module global (the last run begun advised both, and the
    first to end took the other's away)."""
    a, b = (SimpleNamespace(model=torch.nn.Linear(2, 2), model_init=None) for _ in range(2))
    other = torch.nn.Linear(2, 2)
    run_a, run_b = resume_residency.resuming(a, {"optimizer_layers": 1}), resume_residency.resuming(
        b, {"optimizer_layers": 3})
    run_a.__enter__()
    run_b.__enter__()
    try:
        assert (_advised(a.model), _advised(b.model), _advised(other)) == (1, 3, None)
        run_a.__exit__(None, None, None)
        assert (_advised(a.model), _advised(b.model)) == (None, 3)
    finally:
        run_b.__exit__(None, None, None)
    assert _advised(b.model) is None


class _InitTrainer:
    """Trainer's model_init road: train() makes its model anew (call_model_init) before deepspeed.initialize."""

    def __init__(self) -> None:
        self.model, self.model_init = torch.nn.Linear(2, 2), lambda: torch.nn.Linear(2, 2)

    def call_model_init(self) -> torch.nn.Module:
        return self.model_init()


def test_a_model_made_by_model_init_inside_the_run_carries_the_count():
    trainer = _InitTrainer()
    with resume_residency.resuming(trainer, {"optimizer_layers": 2}):
        made = trainer.call_model_init()
        assert _advised(made) == 2 and _advised(trainer.model) == 2
    assert _advised(made) is None and "call_model_init" not in vars(trainer)  # the trainer as it was
