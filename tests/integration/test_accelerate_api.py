"""The Accelerate face's wider API, with accelerate's semantics: examples/accelerate_nlp.py (accelerate's
nlp_example loop: accumulation, schedule, evaluation, tracking, automatic checkpoint naming, mid-epoch resume)
on all three backends, and each added piece on its own."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import make_batches, tiny_model
from examples_module import load_example
from kit import fresh_accelerate_state, start_python, worker_env

from megatrain import Accelerator
from megatrain.config.schema import EngineConfig

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "accelerate_nlp.py"
TOL = 1e-5


def _example():
    return load_example("accelerate_nlp")


def _run(tmp: Path, backend: str, *extra: str) -> dict:
    return _example().main(["--project_dir", str(tmp / backend), "--backend", backend, *extra])


def _close(a: list[float], b: list[float], tol: float = TOL) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.slow
def test_nlp_example_on_megatrain_matches_torch_checkpoints_tracks_and_resumes(tmp_path):
    ref = _run(tmp_path, "torch")
    mt = _run(tmp_path, "megatrain")
    assert len(mt["losses"]) == 24 and len(mt["metrics"]) == 3
    assert _close(mt["losses"], ref["losses"]) <= TOL
    for a, b in zip(mt["metrics"], ref["metrics"]):
        assert abs(a["eval_loss"] - b["eval_loss"]) <= TOL and a["accuracy"] == b["accuracy"]
    # Control: the losses move by more than the tolerance from one batch to the next.
    assert min(abs(x - y) for x, y in zip(ref["losses"], ref["losses"][1:])) > 10 * TOL

    project = tmp_path / "megatrain"
    # Tracking: the configuration once, then one line per epoch, as the loop logged them.
    lines = [json.loads(x) for x in (project / "logs" / "log.jsonl").read_text().splitlines()]
    assert lines[0]["config"]["num_epochs"] == 3
    assert [ln["step"] for ln in lines[1:]] == [0, 1, 2]
    assert [ln["eval_loss"] for ln in lines[1:]] == [m["eval_loss"] for m in mt["metrics"]]
    # Six saves (batches 3 and 6 of each epoch), total_limit=2: the two newest remain, in accelerate's layout.
    ckpts = project / "checkpoints"
    assert sorted(os.listdir(ckpts)) == ["checkpoint_4", "checkpoint_5"]
    files = set(os.listdir(ckpts / "checkpoint_5"))
    assert {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl",
            "custom_checkpoint_0.pkl", "megatrain_accelerator.json"} <= files

    # Resume from the newest (epoch 3, after batch 6): the last two batches and the final evaluation come out
    # bit-identical to the uninterrupted run.
    resumed = _run(tmp_path, "megatrain", "--resume")
    assert resumed["losses"] == mt["losses"][-2:]
    assert resumed["metrics"] == mt["metrics"][-1:]
    # Control: the same positions of the epochs before (other orders of the same rows, accelerate's seedable
    # sampler at epochs 0 and 1) give other losses: the resume replayed epoch 2's order, not any.
    per_epoch = len(mt["losses"]) // 3
    assert all(mt["losses"][e * per_epoch - 2:e * per_epoch] != resumed["losses"] for e in (1, 2))


@pytest.mark.slow
def test_nlp_example_on_zero3_matches_torch(tmp_path):
    from baselines.zero3 import default_extensions_dir

    env = worker_env(world_size=1, TORCH_EXTENSIONS_DIR=default_extensions_dir())
    report, log = tmp_path / "zero3.json", tmp_path / "zero3.log"
    # The ZeRO-3 run in its own process, the torch reference here while it runs (neither reads the other's files).
    proc = start_python([EXAMPLE, "--project_dir", tmp_path / "zero3", "--backend", "zero3", "--epochs", "1",
                         "--report", report], env=env, log=log)
    try:
        ref = _run(tmp_path, "torch", "--epochs", "1")
        proc.wait(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, log.read_text()[-4000:]
    z = json.loads(report.read_text())
    assert _close(z["losses"], ref["losses"]) <= TOL
    assert abs(z["metrics"][0]["eval_loss"] - ref["metrics"][0]["eval_loss"]) <= TOL
    assert sorted(os.listdir(tmp_path / "zero3" / "checkpoints")) == ["checkpoint_0", "checkpoint_1"]
    assert len((tmp_path / "zero3" / "logs" / "log.jsonl").read_text().splitlines()) == 2


# ---------------------------------------------------------------------------------------------------
# the pieces


@pytest.mark.slow
def test_bf16_mixed_precision_selects_bf16_compute_on_megatrain(tmp_path):
    acc = Accelerator(backend="megatrain", mixed_precision="bf16")
    assert acc.backend.engine_config.compute_dtype == "bfloat16" and acc.state.mixed_precision == "bf16"
    fresh_accelerate_state()  # accelerate's state takes one mixed precision per process
    assert Accelerator(backend="megatrain").backend.engine_config.compute_dtype == "float32"
    fresh_accelerate_state()
    with pytest.raises(ValueError, match="compute_dtype='float32'"):
        Accelerator(backend="megatrain", mixed_precision="bf16", config={"megatrain": {"compute_dtype": "float32"}})
    # It trains in bf16: close to FP32, but not equal.
    fp32 = _run(tmp_path, "megatrain", "--epochs", "1")
    fresh_accelerate_state()
    bf16 = _example().main(["--project_dir", str(tmp_path / "bf16"), "--backend", "megatrain", "--epochs", "1",
                            "--mixed_precision", "bf16"])
    assert 0 < _close(bf16["losses"], fp32["losses"]) <= 0.05


def test_cpu_flag():
    acc = Accelerator(backend="megatrain", cpu=True)
    assert acc.device.type == "cpu" and acc.backend.engine_config.device == "cpu"
    assert Accelerator(backend="torch", cpu=True).device.type == "cpu"
    with pytest.raises(ValueError, match="megatrain.device='cuda'"):
        Accelerator(backend="megatrain", cpu=True, config={"megatrain": {"device": "cuda"}})
    with pytest.raises(ValueError, match="device='cuda'"):
        Accelerator(backend="megatrain", cpu=True, config=EngineConfig(device="cuda"))


def _sync_pattern(acc: Accelerator, n: int) -> list[bool]:
    out = []
    for _ in range(n):
        with acc.accumulate():
            out.append(acc.sync_gradients)
    return out


def test_gradient_accumulation_setter_and_plugin():
    from accelerate.utils import GradientAccumulationPlugin

    acc = Accelerator(backend="torch")
    acc.gradient_accumulation_steps = 3
    assert _sync_pattern(acc, 6) == [False, False, True, False, False, True]
    with pytest.raises(ValueError, match="gradient_accumulation_steps=0"):
        acc.gradient_accumulation_steps = 0
    acc = Accelerator(backend="torch", gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2))
    assert acc.gradient_accumulation_steps == 2 and _sync_pattern(acc, 4) == [False, True, False, True]
    with pytest.raises(ValueError, match="not both"):
        Accelerator(backend="torch", gradient_accumulation_steps=2,
                    gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2))
    # sync_with_dataloader=False: the last batch of an epoch does not force a step.
    for flag, expected in ((True, [False, True, False, True, True]), (False, [False, True, False, True, False])):
        acc = Accelerator(backend="torch", gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=2, sync_with_dataloader=flag))
        loader = acc.prepare(torch.utils.data.DataLoader(list(range(5)), batch_size=1))
        seen = []
        for _ in loader:
            with acc.accumulate():
                seen.append(acc.sync_gradients)
        assert seen == expected, (flag, seen)


def _train(acc: Accelerator, model, opt, batches, clip_value: float | None = None) -> list[float]:
    losses = []
    for b in batches:
        with acc.accumulate(model):
            loss = model(**b).loss
            acc.backward(loss)
            if clip_value is not None:
                acc.clip_grad_value_(model.parameters(), clip_value)
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_optimizer_prepared_after_the_model_on_megatrain():
    batches = make_batches(3)
    acc = Accelerator(backend="torch")
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    ref = _train(acc, model, opt, batches)
    for built_after in (False, True):
        acc = Accelerator(backend="megatrain")
        model = tiny_model()
        opt = None if built_after else torch.optim.AdamW(model.parameters(), lr=1e-3)
        model = acc.prepare(model)
        opt = acc.prepare(opt if opt is not None else torch.optim.AdamW(model.parameters(), lr=1e-3))
        assert acc.backend.engine.optimizer is opt.optimizer
        assert _close(_train(acc, model, opt, batches), ref) <= TOL
    with pytest.raises(RuntimeError, match="prepared already"):
        acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-3))
    acc = Accelerator(backend="megatrain")
    model = acc.prepare(tiny_model())
    with pytest.raises(ValueError, match="not a parameter"):
        acc.prepare(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3))


def test_clip_grad_value_matches_torch():
    batches = make_batches(3)
    runs = {}
    for backend, clip in (("torch", 1e-3), ("megatrain", 1e-3), ("torch", None)):
        acc = Accelerator(backend=backend)
        model = tiny_model()
        model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))
        runs[(backend, clip)] = _train(acc, model, opt, batches, clip)
    assert _close(runs[("megatrain", 1e-3)], runs[("torch", 1e-3)]) <= TOL
    assert _close(runs[("torch", None)], runs[("torch", 1e-3)]) > 1e-3  # control: the clamp changed training


@pytest.mark.parametrize("backend", ["zero3", "zero3-alst"])
def test_clip_grad_value_is_refused_where_zero3_partitions_the_gradients(backend):
    # ZeRO-3 keeps the gradients partitioned in DeepSpeed's offload buffers: torch's clamp of the parameters'
    # .grad would touch nothing and report success. zero3-alst is ZeRO-3 too and must refuse the same way.
    acc = Accelerator(backend=backend)
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([-5.0, 0.5, 5.0])
    with pytest.raises(RuntimeError, match="clip_grad_value_"):
        acc.clip_grad_value_([p], 1.0)
    assert torch.equal(p.grad, torch.tensor([-5.0, 0.5, 5.0]))


def test_free_memory_save_main_process_first_and_checkpoint_registration(tmp_path):
    acc = Accelerator(backend="megatrain")
    model = tiny_model()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    with acc.main_process_first():
        pass
    acc.save({"w": torch.arange(3.0)}, tmp_path / "a.pt")
    assert torch.equal(torch.load(tmp_path / "a.pt")["w"], torch.arange(3.0))
    acc.save({"w": torch.arange(3.0)}, tmp_path / "a.safetensors", safe_serialization=True)
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "a.safetensors")["w"], torch.arange(3.0))
    with pytest.raises(ValueError, match="state_dict"):
        acc.register_for_checkpointing(object())
    acc.save_state(tmp_path / "s")
    acc.register_for_checkpointing(torch.nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="custom checkpoints"):
        acc.load_state(tmp_path / "s")  # saved with none registered
    assert acc.free_memory(model, opt) == [None, None]
    assert acc.backend.engine is None and acc._models == []


def test_skip_first_batches_and_bad_inputs(tmp_path):
    acc = Accelerator(backend="torch")
    loader = torch.utils.data.DataLoader(list(range(6)), batch_size=2)
    assert [b.tolist() for b in acc.skip_first_batches(loader, 2)] == [[4, 5]]
    prepared = acc.prepare(loader)
    assert [b.tolist() for b in acc.skip_first_batches(prepared, 1)] == [[2, 3], [4, 5]]
    with pytest.raises(ValueError, match="Unsupported logging capability: nonsense"):  # accelerate's own check
        Accelerator(backend="torch", log_with="nonsense").init_trackers("p")
    with pytest.raises(ValueError, match="needs a project directory"):
        from accelerate.utils import ProjectConfiguration

        Accelerator(backend="torch", project_config=ProjectConfiguration(automatic_checkpoint_naming=True)).save_state()
    with pytest.raises(ValueError, match="needs an output_dir"):
        Accelerator(backend="torch").save_state()
