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

import pytest
import torch
from kit import bits
from safetensors.torch import load_file

from megatrain.commands import sft
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


def test_resuming_leaves_counts_the_user_set_alone():
    from megatrain import backend
    from megatrain.config import EngineConfig

    planner = backend.placement_advice
    cpu = torch.device("cpu")
    with resume_residency.resuming({"optimizer_layers": 2}):
        assert isinstance(backend.placement_advice(cpu, None, EngineConfig()), train_state.CheckpointResidency)
        assert backend.placement_advice(cpu, None, EngineConfig(residency={"weights": 1})) is None
    assert backend.placement_advice is planner
