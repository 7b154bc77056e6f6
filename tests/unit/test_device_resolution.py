"""Device resolution (engine/runtime/device_resolution.py): a CUDA build of torch on a machine where CUDA is not usable
(torch's accelerator API says cuda, torch.cuda.is_available() says no) trains on the CPU with one line saying
why, through every face; an explicit CUDA device there is an error naming the cause and the fix; pinning there
names the cause, not a locked-memory limit."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from conftest import make_batches, tiny_model

import megatrain
from megatrain.config.schema import EngineConfig
from megatrain.engine import Engine
from megatrain.engine.host import pinned
from megatrain.engine.model.placement import resolve_device
from megatrain.engine.runtime import device_resolution


@pytest.fixture
def cuda_build_without_gpu(monkeypatch):
    """What `pip install torch` gives on a machine without a usable GPU: a CUDA build whose accelerator API says
    cuda while CUDA itself is unavailable. `state` picks the cause (no driver, or a driver and no device)."""
    state = {"driver": False}
    # As torch answers there: the build's accelerator, or None when asked whether it is available.
    monkeypatch.setattr(torch.accelerator, "current_accelerator",
                        lambda check_available=False: None if check_available else torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(device_resolution, "_driver_loads", lambda: state["driver"])
    monkeypatch.setattr(device_resolution, "_device_nodes", lambda: [])  # no GPU: not a driver/runtime mismatch
    monkeypatch.setattr(device_resolution, "_driver_devices", lambda: 0)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(device_resolution, "_noted", set())
    return state


def test_the_default_device_is_the_cpu_with_one_line_saying_why(cuda_build_without_gpu, caplog):
    with caplog.at_level(logging.WARNING, logger="megatrain"):
        assert resolve_device(None) == torch.device("cpu")
        assert resolve_device(None) == torch.device("cpu")
    lines = [r.getMessage() for r in caplog.records if r.name == "megatrain"]
    assert len(lines) == 1, lines  # said once, not at every resolution
    assert "training on the CPU" in lines[0] and "no NVIDIA driver" in lines[0] and "\n" not in lines[0]


def test_the_engine_trains_on_the_cpu(cuda_build_without_gpu):
    batches = make_batches(3)

    def run(config: EngineConfig) -> tuple[Engine, list[float]]:
        eng = Engine(tiny_model("llama"), config)
        losses = []
        for b in batches:
            loss = eng(**b).loss
            eng.backward(loss)
            eng.step()
            eng.zero_grad()
            losses.append(float(loss.detach()))
        return eng, losses

    eng, losses = run(EngineConfig())
    assert eng.device == torch.device("cpu") and eng.compute_dtype == torch.float32
    assert eng.store.pinned_bytes == 0  # nothing pinned for a device that is not there
    _, explicit = run(EngineConfig(device="cpu"))
    assert losses == explicit  # the same run as asking for the CPU


def test_the_deepspeed_face_trains_on_the_cpu(cuda_build_without_gpu):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, _, _, _ = megatrain.initialize(model=tiny_model("llama"), config=cfg)
    assert engine.device == torch.device("cpu")
    losses = []
    for b in make_batches(2):
        loss = engine(**b).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert megatrain.accelerator.get_accelerator().device_name() == "cpu"


def test_the_accelerate_face_trains_on_the_cpu(cuda_build_without_gpu):
    acc = megatrain.Accelerator(backend="megatrain")
    assert acc.device == torch.device("cpu")
    model = tiny_model("llama")
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for b in make_batches(2):
        loss = model(**b).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    assert acc.backend.engine.device == torch.device("cpu")


def test_the_metrics_measure_the_device_the_engine_computes_on(cuda_build_without_gpu):
    from megatrain.metrics import device as metrics_device

    assert metrics_device._default_device() == torch.device("cpu")
    assert metrics_device.device_name().startswith("cpu: ")


def test_an_explicit_cuda_device_names_the_cause_and_the_fix(cuda_build_without_gpu, monkeypatch):
    with pytest.raises(ValueError, match=r"device='cuda' is not usable here: no NVIDIA driver.*--gpus all.*'cpu'"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="no NVIDIA driver"):
        Engine(tiny_model("llama", layers=1), EngineConfig(device="cuda:0"))
    cuda_build_without_gpu["driver"] = True
    with pytest.raises(ValueError, match=r"no usable GPU: the NVIDIA driver is installed.*nvidia-smi"):
        resolve_device("cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES='' hides every GPU"):
        resolve_device("cuda:0")
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(ValueError, match="built without CUDA"):
        resolve_device("cuda")


def test_pinning_without_usable_cuda_names_the_cause_not_a_memory_limit(cuda_build_without_gpu):
    # The real registration path (no fake stands in): there is no limit to raise, so the error must not say so.
    with pytest.raises(pinned.PinnedMemoryError) as info:
        Engine(tiny_model("llama", layers=1), EngineConfig(device="cpu", pin_memory=True))
    msg = str(info.value)
    assert "CUDA is not usable here (no NVIDIA driver" in msg and "pin_memory to false" in msg
    assert "ulimit" not in msg


def test_a_usable_accelerator_is_kept(monkeypatch):
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device(None) == torch.device("cuda")  # control: the fallback is for unusable CUDA only
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: None)
    assert resolve_device(None) == torch.device("cpu")


TOO_OLD = ("The NVIDIA driver on your system is too old (found version 12020). Please update your GPU driver by "
           "downloading and installing a new version from the URL: http://www.nvidia.com/Download/index.aspx")


@pytest.fixture
def driver_too_old(cuda_build_without_gpu, monkeypatch):
    """A GPU (device node, a driver that counts it) whose driver (CUDA 12.2) is older than the wheel's CUDA 12.8:
    torch reports no GPU, and its initialisation raises its own reason."""
    monkeypatch.setattr(device_resolution, "_device_nodes", lambda: ["/dev/nvidia0"])
    monkeypatch.setattr(device_resolution, "_driver_devices", lambda: 1)
    monkeypatch.setattr(device_resolution, "_driver_cuda_version", lambda: 12020)
    monkeypatch.setattr(device_resolution, "_driver_loads", lambda: True)

    def init() -> None:
        raise RuntimeError(TOO_OLD)

    monkeypatch.setattr(torch.cuda, "init", init)
    return monkeypatch


def test_a_driver_older_than_the_wheel_is_refused_with_torchs_reason_and_the_fix(driver_too_old, caplog):
    with caplog.at_level(logging.WARNING, logger="megatrain"), \
            pytest.raises(device_resolution.CudaInitError) as info:
        resolve_device(None)
    msg = str(info.value)
    assert "has a GPU (device node /dev/nvidia0)" in msg and "built for CUDA 12.8" in msg
    assert "The NVIDIA driver on your system is too old (found version 12020)" in msg  # torch's own words
    assert "supports CUDA up to 12.2, older than torch's" in msg
    assert "upgrade the NVIDIA driver to one that supports CUDA 12.8" in msg
    assert "torch wheel built for CUDA 12.2 or older" in msg and "device='cpu'" in msg
    assert not [r for r in caplog.records if "training on the CPU" in r.getMessage()]  # no quiet CPU run
    with pytest.raises(device_resolution.CudaInitError):
        Engine(tiny_model("llama", layers=1), EngineConfig())
    with pytest.raises(ValueError, match=r"device='cuda' is not usable here: this machine has a GPU.*too old"):
        resolve_device("cuda")


def test_the_cpu_asked_for_by_name_still_trains_there(driver_too_old):
    eng = Engine(tiny_model("llama", layers=1), EngineConfig(device="cpu"))
    assert eng.device == torch.device("cpu")
    loss = eng(**make_batches(1)[0]).loss
    eng.backward(loss)
    eng.step()
    assert torch.isfinite(loss.detach())


def test_negative_control_without_a_gpu_the_same_torch_falls_back_to_the_cpu(driver_too_old):
    # The same CUDA build and driver, no device node and no device counted: a CPU machine, as before.
    driver_too_old.setattr(device_resolution, "_device_nodes", lambda: [])
    driver_too_old.setattr(device_resolution, "_driver_devices", lambda: 0)
    assert resolve_device(None) == torch.device("cpu")


def test_a_driver_counting_gpus_without_a_node_is_a_gpu_too(driver_too_old):
    driver_too_old.setattr(device_resolution, "_device_nodes", lambda: [])
    with pytest.raises(device_resolution.CudaInitError, match="the NVIDIA driver counts GPUs"):
        resolve_device(None)


def test_a_node_without_the_drivers_library_says_so(driver_too_old):
    driver_too_old.setattr(device_resolution, "_driver_cuda_version", lambda: None)
    driver_too_old.setattr(device_resolution, "_driver_devices", lambda: 0)
    driver_too_old.setattr(device_resolution, "_driver_loads", lambda: False)
    with pytest.raises(device_resolution.CudaInitError, match=r"libcuda.so.1 .* cannot be loaded.*--gpus all"):
        resolve_device(None)


def test_torchs_warning_is_its_reason_where_init_does_not_raise(driver_too_old):
    def init() -> None:
        warnings.warn("CUDA initialization: CUDA unknown error - this may be due to an incorrectly set up "
                      "environment", UserWarning, stacklevel=2)

    driver_too_old.setattr(torch.cuda, "init", init)
    driver_too_old.setattr(device_resolution, "_driver_cuda_version", lambda: 12080)  # not older than the wheel
    with pytest.raises(device_resolution.CudaInitError) as info:
        resolve_device(None)
    msg = str(info.value)
    assert "CUDA initialization: CUDA unknown error" in msg and "nvidia-smi" in msg
    assert "upgrade the NVIDIA driver" not in msg
