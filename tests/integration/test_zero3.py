"""The DeepSpeed ZeRO-3 CPU-offload backend: the real `deepspeed`, driven through Accelerate.

Training runs go in subprocesses (DeepSpeed initialises torch.distributed once per process). The
first run on a machine JIT-builds DeepSpeed's cpu_adam and shm_comm ops (~85 s, cached afterwards
in TORCH_EXTENSIONS_DIR).
"""

from __future__ import annotations

import builtins
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import transformers
from accel_script import probe_batch, torch_reference
from kit import start_python

from baselines import zero3
from megatrain.accelerate import Accelerator

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parents[1] / "workers" / "accel_script.py"
BF16 = {"bf16": {"enabled": True}, "gradient_clipping": "auto"}
_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")



def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a, (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b))


def _launch(task: str, out: Path, kwargs: dict) -> subprocess.Popen:
    # No launcher variable: each run picks its own port.
    return start_python([SCRIPT, task, "zero3", out, json.dumps(kwargs)], stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def zero3_runs():
    """The DeepSpeed runs, started together so their start-ups (imports, op loading) overlap."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        jobs = {
            # With HF gradient checkpointing, as the comparison sweeps run ZeRO-3 (same FLOPs as MegaTrain);
            # the checkpoint run below covers ZeRO-3 without it.
            "train": (_launch("train", tmp / "train.json", {"gradient_checkpointing": True}), tmp / "train.json"),
            "checkpoint": (_launch("checkpoint", tmp / "ckpt.json", {"workdir": str(tmp / "ckpt"), "clip": 1e-6}),
                           tmp / "ckpt.json"),
            "bf16": (_launch("train", tmp / "bf16.json", {"steps": 3, "config": BF16}), tmp / "bf16.json"),
        }
        # The references run here while the DeepSpeed processes start up.
        refs = {"train": torch_reference("train"), "clip": torch_reference("checkpoint", clip=1e-6),
                "unclipped": torch_reference("checkpoint", clip=1.0)}
        results = {"ref": refs}
        for name, (proc, path) in jobs.items():
            log, _ = proc.communicate(timeout=1200)
            if proc.returncode != 0:
                pytest.fail(f"zero3 {name} run failed (exit {proc.returncode}):\n{log[-6000:]}")
            results[name] = json.loads(path.read_text())
        # Reload in this process: DeepSpeed's process would build the HF model partitioned.
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp / "ckpt" / "hf")
        with torch.no_grad():
            results["reload_loss"] = reloaded(**probe_batch()).loss.item()
        yield results


@pytest.mark.deepspeed
@pytest.mark.slow
def test_zero3_matches_torch(zero3_runs):
    ref = zero3_runs["ref"]["train"]
    z = zero3_runs["train"]
    assert z["gradient_checkpointing"] is True and ref["gradient_checkpointing"] is False
    assert max_diff(z["losses"], ref["losses"]) <= 1e-4
    # The norm clip_grad_norm_ reports comes from DeepSpeed's partitioned gradients.
    assert max_diff(z["norms"], ref["norms"]) <= 1e-4 * max(ref["norms"])
    assert z["lrs"] == pytest.approx(ref["lrs"], rel=1e-9)  # the user's LambdaLR drives DeepSpeedCPUAdam


@pytest.mark.deepspeed
@pytest.mark.slow
def test_zero3_clips_resumes_and_saves(zero3_runs):
    z = zero3_runs["checkpoint"]
    ref, unclipped = zero3_runs["ref"]["clip"], zero3_runs["ref"]["unclipped"]
    # clip_grad_norm_ between backward and step reaches DeepSpeed's own clipping: the run matches
    # torch at the same threshold and is far from torch without effective clipping.
    assert max_diff(z["losses"], ref["losses"]) <= 1e-4
    assert max_diff(z["losses"], unclipped["losses"]) > 1e-3
    assert max_diff(z["redo"], z["losses"][4:]) <= 1e-6  # load_state resumes where save_state was
    assert abs(zero3_runs["reload_loss"] - z["model_loss"]) <= 1e-5  # save_model wrote the gathered weights


@pytest.mark.deepspeed
@pytest.mark.slow
def test_zero3_bf16_trains_close_to_fp32(zero3_runs):
    diff = max_diff(zero3_runs["bf16"]["losses"], zero3_runs["ref"]["train"]["losses"][:6])
    assert 0 < diff <= 0.05, diff  # not identical: DeepSpeed's bf16 path really ran


# -- no DeepSpeed run needed ------------------------------------------------------------------------


def test_missing_deepspeed_says_how_to_install(monkeypatch):
    real_import = builtins.__import__

    def no_deepspeed(name, *args, **kwargs):
        if name == "deepspeed" or name.startswith("deepspeed."):
            raise ImportError("No module named 'deepspeed'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_deepspeed)
    with pytest.raises(ImportError, match=r'pip install "megatrain\[deepspeed\]"'):
        Accelerator(backend="zero3")
    # The other backends do not need it.
    assert Accelerator(backend="torch").backend.name == "torch"


def test_ds_config_is_zero3_cpu_offload():
    cfg = zero3.build_ds_config(None, gradient_accumulation_steps=2, mixed_precision="no", micro_batch_size=4)
    z = cfg["zero_optimization"]
    assert z["stage"] == 3
    assert z["offload_param"]["device"] == z["offload_optimizer"]["device"] == "cpu"
    pin = torch.accelerator.current_accelerator(check_available=True) is not None  # pinning raises on a CPU-only build
    assert z["offload_param"]["pin_memory"] is pin and z["offload_optimizer"]["pin_memory"] is pin
    assert cfg["gradient_accumulation_steps"] == 2
    assert cfg["train_micro_batch_size_per_gpu"] == 4 and cfg["train_batch_size"] == 8
    assert cfg["bf16"]["enabled"] is False and cfg["gradient_clipping"] == 0.0


def test_ds_config_keeps_the_users_settings_and_refuses_contradictions():
    user = {"zero_optimization": {"stage": 3, "sub_group_size": 123}, "megatrain": {"num_buffers": 3},
            "bf16": {"enabled": "auto"}, "gradient_accumulation_steps": "auto"}
    cfg = zero3.build_ds_config(user, gradient_accumulation_steps=3, mixed_precision="bf16", micro_batch_size=None,
                                gradient_clipping=0.5)
    assert cfg["zero_optimization"]["sub_group_size"] == 123 and "megatrain" not in cfg
    assert cfg["bf16"]["enabled"] is True and cfg["gradient_accumulation_steps"] == 3
    assert cfg["gradient_clipping"] == 0.5
    assert user["bf16"]["enabled"] == "auto"  # the caller's dict is not modified
    with pytest.raises(ValueError, match="stage"):
        zero3.build_ds_config({"zero_optimization": {"stage": 2}}, gradient_accumulation_steps=1,
                              mixed_precision="no", micro_batch_size=1)
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        zero3.build_ds_config({"gradient_accumulation_steps": 4}, gradient_accumulation_steps=2,
                              mixed_precision="no", micro_batch_size=1)
    with pytest.raises(ValueError, match="bf16"):
        zero3.build_ds_config({"bf16": {"enabled": True}}, gradient_accumulation_steps=1,
                              mixed_precision="no", micro_batch_size=1)


def test_ds_config_applies_the_documented_offload_tuning():
    cfg = zero3.build_ds_config(None, gradient_accumulation_steps=1, mixed_precision="no", micro_batch_size=1,
                                hidden_size=1024)
    z = cfg["zero_optimization"]
    # Hugging Face's documented ZeRO-3 offload config, "auto" sizes resolved as Accelerate does
    assert z["reduce_bucket_size"] == 1024 * 1024
    assert z["stage3_prefetch_bucket_size"] == int(0.9 * 1024 * 1024)
    assert z["stage3_param_persistence_threshold"] == 10 * 1024
    assert z["overlap_comm"] is True and z["contiguous_gradients"] is True
    assert z["stage3_max_live_parameters"] == z["stage3_max_reuse_distance"] == z["sub_group_size"] == 10**9
    # the user's own value wins; an explicit "auto" is resolved
    user = {"zero_optimization": {"stage3_prefetch_bucket_size": 77, "reduce_bucket_size": "auto"}}
    z = zero3.build_ds_config(user, gradient_accumulation_steps=1, mixed_precision="no", micro_batch_size=1,
                              hidden_size=64)["zero_optimization"]
    assert z["stage3_prefetch_bucket_size"] == 77 and z["reduce_bucket_size"] == 64 * 64
    # no hidden size (a model without an HF config): the sizes are DeepSpeed's own defaults
    z = zero3.build_ds_config(None, gradient_accumulation_steps=1, mixed_precision="no",
                              micro_batch_size=1)["zero_optimization"]
    assert "stage3_prefetch_bucket_size" not in z and "reduce_bucket_size" not in z


def test_environment_for_a_plain_python_run(monkeypatch):
    for key in (*_RENDEZVOUS, "TORCH_EXTENSIONS_DIR"):
        # set first, so monkeypatch records the key as it was and undoes what prepare_environment sets (a delenv
        # of an absent key records nothing: RANK, WORLD_SIZE and MASTER_* stayed set for every later test)
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    monkeypatch.setenv("PATH", "/usr/bin")
    zero3.prepare_environment()
    assert (os.environ["MASTER_ADDR"], os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == (
        "127.0.0.1", "0", "1", "0")
    assert 0 < int(os.environ["MASTER_PORT"]) < 65536
    assert os.environ["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable)  # pip's ninja
    assert os.environ["TORCH_EXTENSIONS_DIR"] == zero3.default_extensions_dir()
    assert os.path.join(".cache", "megatrain", "torch_extensions") in zero3.default_extensions_dir()
    # What the user set wins.
    monkeypatch.setenv("MASTER_PORT", "29517")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/tmp/ext")
    zero3.prepare_environment()
    assert os.environ["MASTER_PORT"] == "29517" and os.environ["TORCH_EXTENSIONS_DIR"] == "/tmp/ext"
    assert os.environ["PATH"].count(os.path.dirname(sys.executable)) == 1


def test_only_adam_can_be_offloaded_to_deepspeed_cpu_adam():
    # Accelerate would turn any torch optimizer into DeepSpeedCPUAdam; an SGD must not train as Adam.
    model = torch.nn.Linear(2, 2)
    acc = Accelerator(backend="zero3")
    with pytest.raises(TypeError, match="SGD"):
        acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="amsgrad"):
        acc.prepare(model, torch.optim.AdamW(model.parameters(), amsgrad=True))
