"""`deepspeed.accelerator` (and `from deepspeed import get_accelerator`): the device MegaTrain computes on, answered
with DeepSpeed's accelerator verbs.

DeepSpeed's `get_accelerator()` returns an object implementing `deepspeed.accelerator.abstract_accelerator.
DeepSpeedAccelerator`; scripts call its verbs to pick and query their device (`set_device(local_rank)`,
`device_name()`, `current_device_name()`, `synchronize()`, `empty_cache()`, memory counters, RNG, streams). Here
each verb answers for the device MegaTrain's engine resolves (a CUDA build without a GPU is the CPU), as DeepSpeed's
CUDA accelerator answers on a GPU and its CPU accelerator on the CPU. It is MegaTrain's own and not DeepSpeed's
because it must work where the name `deepspeed` is MegaTrain's (every deepspeed import redirected) and it must name
the device MegaTrain trains on. The few verbs that build DeepSpeed's C++ ops or CUDA graphs are refused by name
(`REFUSED`); tests/unit/test_ds_surface.py compares the verbs with DeepSpeed's abstract accelerator.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from ..engine import resolve_device

__all__ = ["get_accelerator", "REFUSED"]

# DeepSpeed's accelerator verbs this one refuses, with the reason (the rest it answers).
REFUSED = {
    name: "DeepSpeed's C++ op builders: MegaTrain builds no DeepSpeed op (its optimizer and kernels are its own)"
    for name in ("op_builder_dir", "create_op_builder", "get_op_builder", "build_extension")
} | {
    name: "CUDA graphs: MegaTrain's engine streams layers with its own copy schedule; capture them with torch.cuda "
          "directly if needed"
    for name in ("create_graph", "capture_to_graph", "replay_graph")
}


class _DeviceAccelerator:
    """What `deepspeed.get_accelerator()` answers, for the device MegaTrain computes on."""

    def __init__(self) -> None:
        self._device = resolve_device(None)  # as the engine resolves it: a CUDA build without a GPU is the CPU
        self._cpu = self._device.type == "cpu"
        self._name = self._device.type
        self._compile_backend = "inductor"

    def _mod(self) -> Any:
        return torch.get_device_module(self._device)

    def __getattr__(self, name: str) -> Any:
        if name in REFUSED:
            raise AttributeError(f"get_accelerator().{name} is not available on MegaTrain: {REFUSED[name]}")
        raise AttributeError(name)

    # -- which device ------------------------------------------------------------------------------
    def is_synchronized_device(self) -> bool:
        return self._cpu  # the CPU runs each op to its end; a GPU queues them

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    def device_name(self, device_index: int | None = None) -> str:
        if device_index is None or self._cpu:
            return self._name
        return f"{self._name}:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device | None:
        return None if self._cpu else torch.device(self._name, device_index)

    def set_device(self, device_index: int) -> None:
        if not self._cpu:
            self._mod().set_device(device_index)

    def current_device(self) -> int:
        if self._cpu:
            return int(os.environ.get("LOCAL_RANK", "0") or 0)  # as DeepSpeed's CPU accelerator
        return self._mod().current_device()

    def current_device_name(self) -> str:
        return self._name if self._cpu else f"{self._name}:{self._mod().current_device()}"

    def device_count(self) -> int:
        return 1 if self._cpu else self._mod().device_count()

    def is_available(self) -> bool:
        return True

    def synchronize(self, device_index: int | None = None) -> None:
        if not self._cpu:
            self._mod().synchronize(device_index)

    def communication_backend_name(self) -> str:
        return "nccl" if self._name == "cuda" else "gloo"

    def is_triton_supported(self) -> bool:
        return self._name == "cuda"

    def visible_devices_envs(self) -> list[str]:
        return [] if self._cpu else [f"{self._name.upper()}_VISIBLE_DEVICES"]

    def set_visible_devices_envs(self, current_env: dict[str, str], local_accelerator_ids: list[int]) -> None:
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(map(str, local_accelerator_ids))

    def export_envs(self) -> list[str]:
        return ["NCCL"] if self._name == "cuda" else []

    def get_compile_backend(self) -> str:
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        self._compile_backend = backend

    def lazy_call(self, callback: Any) -> Any:
        return callback() if self._cpu else self._mod()._lazy_call(callback)

    def range_push(self, msg: str, domain: Any = None, category: Any = None) -> None:
        if self._name == "cuda":
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self, domain: Any = None) -> None:
        if self._name == "cuda":
            torch.cuda.nvtx.range_pop()

    # -- RNG ---------------------------------------------------------------------------------------
    def random(self) -> Any:
        return torch.random

    def manual_seed(self, seed: int) -> None:
        if self._cpu:
            torch.manual_seed(seed)
        else:
            self._mod().manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        if self._cpu:
            torch.manual_seed(seed)
        else:
            self._mod().manual_seed_all(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed() if self._cpu else self._mod().initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if self._cpu:
            return torch.get_rng_state()
        return self._mod().get_rng_state() if device_index is None else self._mod().get_rng_state(device_index)

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self._cpu:
            torch.set_rng_state(new_state)
        elif device_index is None:
            self._mod().set_rng_state(new_state)
        else:
            self._mod().set_rng_state(new_state, device_index)

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.default_generator if self._cpu else self._mod().default_generators[device_index]

    # -- streams and events ------------------------------------------------------------------------
    @property
    def Stream(self) -> Any:  # noqa: N802  DeepSpeed's name
        return self._mod().Stream

    @property
    def Event(self) -> Any:  # noqa: N802  DeepSpeed's name
        return self._mod().Event

    def stream(self, stream: Any) -> Any:
        return self._mod().stream(stream)

    def current_stream(self, device_index: int | None = None) -> Any:
        return self._mod().current_stream() if self._cpu else self._mod().current_stream(device_index)

    def default_stream(self, device_index: int | None = None) -> Any:
        return self._mod().current_stream() if self._cpu else self._mod().default_stream(device_index)

    # -- memory ------------------------------------------------------------------------------------
    def _host_rss(self) -> int:
        import psutil

        return psutil.Process().memory_info().rss

    def empty_cache(self) -> None:
        if not self._cpu:
            self._mod().empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return self._host_rss() if self._cpu else self._mod().memory_allocated(device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return self._host_rss() if self._cpu else self._mod().max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        if not self._cpu:
            self._mod().reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return self._host_rss() if self._cpu else self._mod().memory_reserved(device_index)

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return self._host_rss() if self._cpu else self._mod().max_memory_reserved(device_index)

    memory_cached = memory_reserved
    max_memory_cached = max_memory_reserved
    reset_max_memory_cached = reset_max_memory_allocated

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if not self._cpu:
            self._mod().reset_peak_memory_stats(device_index)

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        return {} if self._cpu else self._mod().memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        if self._cpu:
            import psutil

            return psutil.virtual_memory().total
        return self._mod().get_device_properties(device_index or self.current_device()).total_memory

    def available_memory(self, device_index: int | None = None) -> int:
        if self._cpu:
            import psutil

            return psutil.virtual_memory().available
        free, _ = self._mod().mem_get_info(device_index or self.current_device())
        return free

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor if self._cpu else tensor.pin_memory()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return False if self._cpu else tensor.is_pinned()

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    # -- dtypes ------------------------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return False  # MegaTrain computes in FP32 or bf16

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float, torch.bfloat16]

    def _tensor_type(self, dtype: torch.dtype) -> Any:
        return functools.partial(torch.tensor, dtype=dtype, device=self._name)

    @property
    def BFloat16Tensor(self) -> Any:  # noqa: N802  DeepSpeed's names, below too
        return self._tensor_type(torch.bfloat16)

    @property
    def ByteTensor(self) -> Any:  # noqa: N802
        return self._tensor_type(torch.uint8)

    @property
    def DoubleTensor(self) -> Any:  # noqa: N802
        return self._tensor_type(torch.double)

    @property
    def FloatTensor(self) -> Any:  # noqa: N802
        return self._tensor_type(torch.float)

    @property
    def HalfTensor(self) -> Any:  # noqa: N802
        return self._tensor_type(torch.half)

    @property
    def IntTensor(self) -> Any:  # noqa: N802
        return self._tensor_type(torch.int)

    @property
    def LongTensor(self) -> Any:  # noqa: N802
        return self._tensor_type(torch.long)


_ACCELERATOR: list[_DeviceAccelerator] = []


def get_accelerator() -> _DeviceAccelerator:
    """`deepspeed.get_accelerator()` / `deepspeed.accelerator.get_accelerator()` on MegaTrain (one per process, as
    DeepSpeed's)."""
    if not _ACCELERATOR:
        _ACCELERATOR.append(_DeviceAccelerator())
    return _ACCELERATOR[0]
