"""The defaults that differ on CUDA: bf16 compute where the device supports it, and the layer updates overlapped
with the next forward for torch's Adam/AdamW. A CPU device keeps FP32 and the whole step; the faces keep the
precision their own configs say (DeepSpeed: FP32 unless bf16 is enabled; Accelerate: mixed_precision)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from megatrain.config.resolve import engine_config_from
from megatrain.config.schema import EngineConfig
from megatrain.config.settle import EngineFacts, settle_engine
from megatrain.engine import Engine, optimizer_fact


@pytest.fixture
def cuda(monkeypatch):
    """A machine with a bf16-capable CUDA device, as far as the defaults can tell."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    support = {"bf16": True}
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: support["bf16"])
    return support


def test_compute_dtype_auto_is_bf16_on_a_cuda_device_that_supports_it(cuda):
    assert EngineConfig().compute_dtype == "bfloat16"
    assert EngineConfig(device="cuda:1").compute_dtype == "bfloat16"
    assert EngineConfig(device="cpu").compute_dtype == "float32"
    assert EngineConfig(compute_dtype="float32").compute_dtype == "float32"  # asked for: kept
    assert EngineConfig(host_master="hilo").host_master == "hilo"  # hilo needs bf16 compute: the default gives it
    cuda["bf16"] = False
    assert EngineConfig().compute_dtype == "float32"


def test_compute_dtype_auto_is_fp32_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same on a machine that has one
    assert EngineConfig().compute_dtype == "float32"
    assert EngineConfig.from_dict({"compute_dtype": "auto"}).compute_dtype == "float32"
    with pytest.raises(ValueError, match="compute_dtype='float16' is not supported"):
        EngineConfig(compute_dtype="float16")


def test_the_deepspeed_face_trains_in_fp32_unless_bf16_is_enabled(cuda):
    base = {"train_micro_batch_size_per_gpu": 1}
    assert engine_config_from(base).compute_dtype == "float32"
    assert engine_config_from({**base, "bf16": {"enabled": True}}).compute_dtype == "bfloat16"
    assert engine_config_from({**base, "megatrain": {"compute_dtype": "auto"}}).compute_dtype == "bfloat16"


def test_overlap_auto_pays_on_cuda_with_adamw_only():
    model = torch.nn.Linear(2, 2)
    adamw, sgd = torch.optim.AdamW(model.parameters()), torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = EngineConfig(device="cpu")
    assert cfg.optimizer_overlap is None

    def overlap(device: str, optimizer: torch.optim.Optimizer, config: EngineConfig = cfg) -> bool:
        return settle_engine(config, EngineFacts(device, optimizer_fact(optimizer)))[0].optimizer_overlap

    assert overlap("cuda", adamw)
    assert not overlap("cpu", adamw)
    assert not overlap("cuda", sgd)  # would step whole anyway: no warning about a default
    assert not overlap("cuda", adamw, EngineConfig(device="cpu", optimizer_in_backward=True))


def test_a_cpu_engine_keeps_fp32_and_the_whole_step_by_default():
    eng = Engine(tiny_model("llama", layers=1), EngineConfig(device="cpu"))
    assert eng.compute_dtype == torch.float32 and eng.config.optimizer_overlap is False
    assert not eng.update.overlapped and eng.update.layered is None
    eng = Engine(tiny_model("llama", layers=1), EngineConfig(device="cpu", optimizer_overlap=True))
    assert eng.update.overlapped  # asked for: kept
