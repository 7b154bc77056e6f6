"""Every run on MegaTrain says so in one line (face, device, compute dtype, host mode, optimizer, what was turned off),
and a Trainer run with a MegaTrain DeepSpeed config is not ZeRO-3 to transformers from the start (no zero.init)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import make_batches, tiny_model
from kit import start_python, worker_env

from megatrain.config import EngineConfig
from megatrain.run import start_line

ROOT = Path(__file__).resolve().parents[2]


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(start_line.PREFIX)]


def test_deepspeed_face_says_what_runs_and_what_it_turned_off(caplog):
    import megatrain

    caplog.set_level(logging.INFO, logger="megatrain")
    model = tiny_model(layers=2, hidden=32, vocab=128)
    model.gradient_checkpointing_enable()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                    "stage3_max_live_parameters": 1e9},
              "megatrain": {"device": "cpu", "compute_dtype": "float32"}}
    engine, *_ = megatrain.initialize(model=model, config=config)
    (line,) = _lines(caplog)
    assert "face: DeepSpeed (megatrain.initialize) |" in line  # called directly: no route named
    assert "device: cpu | compute: float32 | host: fp32 master, float32 gradients | optimizer: AdamW |" in line
    assert "HF gradient checkpointing (the engine recomputes each streamed layer itself)" in line
    assert "pin_memory (no CUDA device)" in line
    assert "zero_optimization.stage3_max_live_parameters" in line
    batch = make_batches(1, vocab=128)[0]
    engine.backward(engine(**batch).loss)
    engine.step()
    assert len(_lines(caplog)) == 1  # once per run, not per step


def test_accelerate_face_says_what_runs(caplog):
    from megatrain.accelerate import Accelerator

    caplog.set_level(logging.INFO, logger="megatrain")
    config = {"megatrain": {"host_master": "hilo", "compute_dtype": "bfloat16"}}
    acc = Accelerator(backend="megatrain", config=config, mixed_precision="bf16", gradient_checkpointing=True, cpu=True)
    model = tiny_model(layers=2, hidden=32, vocab=128)
    acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    (line,) = _lines(caplog)
    assert "face: Accelerate (megatrain.Accelerator) | device: cpu | compute: bfloat16 | host: hilo master" in line
    assert "optimizer: AdamW | turned off: gradient_checkpointing=True" in line


def test_accelerate_face_says_what_preparing_the_model_turned_off(caplog):
    """The model's own HF checkpointing, turned off by the backend's prepare_model, is named as the DeepSpeed face
    names it."""
    from megatrain.accelerate import Accelerator

    caplog.set_level(logging.INFO, logger="megatrain")
    acc = Accelerator(backend="megatrain", config={"megatrain": {"compute_dtype": "float32"}}, cpu=True)
    model = tiny_model(layers=2, hidden=32, vocab=128)
    model.gradient_checkpointing_enable()
    acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    (line,) = _lines(caplog)
    assert "turned off: " in line and "HF gradient checkpointing (the engine recomputes each streamed layer itself)" in line
    assert not model.is_gradient_checkpointing


def test_without_logging_configured_the_line_goes_to_stderr(capsys):
    class Engine:  # what describe() reads
        config = EngineConfig(compute_dtype="float32", host_master="fp32", host_grad_dtype="float32",
                              optimizer_in_backward=True, residency="auto")
        device = torch.device("cpu")
        dp = None

    logger = logging.getLogger("megatrain")
    assert not logger.isEnabledFor(logging.INFO) or not (logger.handlers or logging.getLogger().handlers)
    with start_line.via("a test's road"):
        start_line.announce(start_line.describe("X", Engine()), Engine())
    err = capsys.readouterr().err
    assert err.startswith("[megatrain] MegaTrain is training | face: X via a test's road |")
    assert "host: fp32 master, optimizer in backward | optimizer: none (forward only) | turned off: nothing" in err


def _trainer_run(model_dir: Path, out: Path, *extra: str) -> subprocess.Popen:
    from baselines.zero3 import default_extensions_dir

    env = worker_env(drop=("MEGATRAIN_DEEPSPEED_GUARD",), threads=1,
                     TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR", default_extensions_dir()))
    out.mkdir()
    (out / "model").symlink_to(model_dir)
    return start_python([ROOT / "tests" / "workers" / "start_line_trainer_script.py", out, *extra], cwd=out, env=env,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_trainer_run_is_not_zero3_to_transformers_and_says_what_runs(tmp_path):
    """As `python run_clm.py` with a ZeRO-3 offload config: arguments first, then from_pretrained, then Trainer."""
    pytest.importorskip("deepspeed")
    # Saved here: a save in the script itself would import deepspeed (accelerate's unwrap) before from_pretrained.
    tiny_model(layers=2, hidden=32, vocab=128).save_pretrained(tmp_path / "model")
    runs = {"new": _trainer_run(tmp_path / "model", tmp_path / "new"),
            "old": _trainer_run(tmp_path / "model", tmp_path / "old", "old-order")}
    logs = {}
    for name, proc in runs.items():
        logs[name], _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, logs[name][-4000:]
    new = logs["new"]
    report = json.loads(next(ln for ln in new.splitlines() if ln.startswith("REPORT "))[7:])
    assert report == {"engine": "MegaTrainEngine", "optimizer": "AdamW"}
    assert "zero.init()" not in new
    (line,) = [ln for ln in new.splitlines() if start_line.PREFIX in ln]
    assert "face: DeepSpeed (megatrain.initialize) via deepspeed.initialize (HF Trainer / accelerate) |" in line
    assert "optimizer: AdamW (DeepSpeedCPUAdam(adamw_mode=True) -> torch.optim.AdamW)" in line
    assert "HF gradient checkpointing (the engine recomputes each streamed layer itself)" in line
    # Control: with routing installed only at the first `import deepspeed` (the old order) transformers has
    # already taken the config for ZeRO-3 when from_pretrained asks.
    assert "Detected DeepSpeed ZeRO-3: activating zero.init() for this model" in logs["old"]
