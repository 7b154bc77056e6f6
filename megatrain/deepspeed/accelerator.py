"""`deepspeed.accelerator`: `get_accelerator()`, the device MegaTrain computes on, in DeepSpeed's terms."""

from __future__ import annotations

import torch

from ..engine import resolve_device

__all__ = ["get_accelerator"]


class _DeviceAccelerator:
    """What `deepspeed.accelerator.get_accelerator()` answers, for the device MegaTrain computes on."""

    def __init__(self) -> None:
        self._device = resolve_device(None)  # as the engine resolves it: a CUDA build without a GPU is the CPU

    def device_name(self, device_index: int | None = None) -> str:
        if device_index is None or self._device.type == "cpu":
            return self._device.type
        return f"{self._device.type}:{device_index}"

    def current_device_name(self) -> str:
        if self._device.type == "cpu":
            return "cpu"
        return f"{self._device.type}:{torch.get_device_module(self._device).current_device()}"

    def current_device(self) -> int:
        return 0 if self._device.type == "cpu" else torch.get_device_module(self._device).current_device()

    def device_count(self) -> int:
        return 1 if self._device.type == "cpu" else torch.get_device_module(self._device).device_count()

    def is_available(self) -> bool:
        return True

    def communication_backend_name(self) -> str:
        return "nccl" if self._device.type == "cuda" else "gloo"

    def synchronize(self, device_index: int | None = None) -> None:
        if self._device.type != "cpu":
            torch.get_device_module(self._device).synchronize()

    def empty_cache(self) -> None:
        if self._device.type != "cpu":
            torch.get_device_module(self._device).empty_cache()

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return False  # MegaTrain computes in FP32 or bf16


def get_accelerator() -> _DeviceAccelerator:
    """`deepspeed.accelerator.get_accelerator()` under `import megatrain as deepspeed`."""
    return _DeviceAccelerator()
