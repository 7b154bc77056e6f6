"""Plain single-device PyTorch: the model on one device, the user's optimizer as is.

This is the reference every other backend is checked against, so it does nothing clever: the
forward is the model's own, gradients come from `loss.backward()`, and clipping and the step are
torch's.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

_MODEL_FILE = "model.safetensors"
_OPTIMIZER_FILE = "optimizer.pt"


def _default_device() -> torch.device:
    return torch.accelerator.current_accelerator(check_available=True) or torch.device("cpu")


class TorchBackend:
    name = "torch"
    # What the face may rely on (megatrain.backend.Backend): one process, torch's own clipping and autocast.
    data_parallel = False  # no gradient averaging: N ranks would train N unrelated models
    reads_engine_config = False
    supports_clip_value = True
    partitions_params = False
    fixed_accumulation_steps = False
    needs_autocast = True
    trains_many_models = True
    main_process_writes = False

    def __init__(
        self,
        *,
        config: dict[str, Any] | None = None,
        gradient_accumulation_steps: int = 1,
        mixed_precision: str = "no",
        gradient_checkpointing: bool = False,
        gradient_clipping: float = 0.0,
        device: str | torch.device | None = None,
        cpu: bool = False,
    ) -> None:
        if config is not None and not isinstance(config, dict):
            raise TypeError(f'backend "torch" takes a DeepSpeed-style config dict, not {type(config).__name__}')
        # A config's gradient_clipping means "clip before every step unless the script clips itself",
        # as DeepSpeed does; honoured so one config means the same training on every backend.
        self._config_clip = float(gradient_clipping)
        self._mixed_precision = mixed_precision
        self._gradient_checkpointing = gradient_checkpointing
        if cpu:
            device = "cpu"
        self._device = torch.device(device) if device is not None else _default_device()
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._clipped = False

    @property
    def device(self) -> torch.device:
        return self._device

    def prepare(
        self,
        model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        *,
        micro_batch_size: int | None = None,
    ) -> tuple[Any, torch.optim.Optimizer | None]:
        if model is not None:
            # .to() moves parameters in place, so an optimizer built on them before still holds them.
            model.to(self._device)
            if self._gradient_checkpointing:
                model.gradient_checkpointing_enable()
            if self._mixed_precision == "bf16" and not hasattr(model, "_megatrain_fp32_forward"):
                # Like Accelerate: weights stay FP32, the forward runs under bf16 autocast.
                model._megatrain_fp32_forward = model.forward
                model.forward = torch.autocast(self._device.type, dtype=torch.bfloat16)(model.forward)
                functools.update_wrapper(model.forward, model._megatrain_fp32_forward)
            self.model = model
        if optimizer is not None:
            self.optimizer = optimizer
        return model, optimizer

    def backward(self, loss: torch.Tensor, *, sync: bool) -> None:
        loss.backward()

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, norm_type: float = 2.0
    ) -> float:
        self._clipped = True
        return float(torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type))

    def _require_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise RuntimeError('backend "torch": prepare an optimizer first')
        return self.optimizer

    def optimizer_step(self) -> None:
        opt = self._require_optimizer()
        if self._config_clip > 0 and not self._clipped:
            params = [p for g in opt.param_groups for p in g["params"]]
            torch.nn.utils.clip_grad_norm_(params, self._config_clip)
        self._clipped = False
        opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._require_optimizer().zero_grad(set_to_none=set_to_none)

    def step_was_skipped(self) -> bool:
        return False

    def unwrap_model(self, model: Any) -> torch.nn.Module:
        return model

    def get_state_dict(self, model: Any) -> dict[str, torch.Tensor]:
        return self.unwrap_model(model).state_dict()

    def save_model(self, model: Any, directory: str | os.PathLike) -> None:
        self.unwrap_model(model).save_pretrained(str(directory))

    def save_state(self, directory: str | os.PathLike) -> None:
        from safetensors.torch import save_model

        d = Path(directory)
        if self.model is not None:
            save_model(self.model, str(d / _MODEL_FILE))  # handles tied weights, unlike save_file
        if self.optimizer is not None:
            torch.save(self.optimizer.state_dict(), d / _OPTIMIZER_FILE)

    def load_state(self, directory: str | os.PathLike) -> None:
        from safetensors.torch import load_model

        d = Path(directory)
        if self.model is not None:
            load_model(self.model, str(d / _MODEL_FILE), device=str(self._device))
        if self.optimizer is not None:
            self.optimizer.load_state_dict(torch.load(d / _OPTIMIZER_FILE, map_location="cpu", weights_only=True))
