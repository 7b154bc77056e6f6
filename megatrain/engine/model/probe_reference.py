"""The parity probe's reference: plain PyTorch trained on the probe's batches, in FP32 or in the engine's
mixed-precision scheme (FP32 masters and gradients, bf16 compute, the engine's cast points), and its bf16 floor."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...models.mixed_precision import cast_points
from .probe_shrink import _seed

# The probe's run: a few plain-SGD steps (an update linear in the gradient, see probe.GRAD_RTOL) on small batches.
STEPS = 3
LR = 0.05
ADAM_LR = 1e-3  # the bf16 phase with hi/lo masters or bf16 gradient slabs (AdamW only, update.py)
_VOCAB = 256
_SEQ = 24


def _batches(n: int, vocab: int, seq: int, seed: int = 1234, pad: bool = True) -> list[dict[str, torch.Tensor]]:
    """Left padding on one row and a few unlabelled tokens: the masks and the loss's ignore path are exercised.
    Without `pad` every position is attended (the probe's retry for models plain transformers trains only so)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, vocab, (2, seq), generator=g)
        mask = torch.ones_like(ids)
        if pad:
            mask[1, : seq // 4] = 0
        labels = ids.masked_fill(mask == 0, -100)
        labels[0, torch.randint(0, seq, (3,), generator=g)] = -100
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out

@dataclass
class _Mode:
    """What the engine the probe stands for computes in: its compute dtype and host modes (EngineConfig)."""

    compute_dtype: str = "float32"
    host_master: str = "fp32"
    host_grad_dtype: str = "float32"

    @classmethod
    def of(cls, config: Any | None) -> _Mode:
        if config is None or config.compute_dtype != "bfloat16":
            return cls()
        # host_master "bf16" rounds its masters by design (docs/HOST_MODES.md): the probe proves the computation
        # with an exact master, which is what that mode rounds.
        master = config.host_master if config.host_master in ("fp32", "hilo") else "fp32"
        return cls("bfloat16", master, config.host_grad_dtype)

    @property
    def bf16(self) -> bool:
        return self.compute_dtype == "bfloat16"

def _optimizer(mode: _Mode, bf16_phase: bool) -> Callable[[Any], torch.optim.Optimizer]:
    # The exact host modes other than the FP32 master step with torch's AdamW only (update.py); elsewhere plain
    # SGD, whose update is linear in the gradient (see GRAD_RTOL).
    if bf16_phase and (mode.host_master != "fp32" or mode.host_grad_dtype != "float32"):
        return lambda params: torch.optim.AdamW(params, lr=ADAM_LR)
    return lambda params: torch.optim.SGD(params, lr=LR)

def train_plain(master: nn.Module, batches: list, dtype: torch.dtype, make_opt: Callable[[Any], Any],
                attn: str | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch, the reference: per-step losses and first-step gradients (on the FP32 masters).

    FP32: the model trains itself. bf16, the engine's mixed-precision scheme: a compute copy with every parameter
    in bf16 and the buffers as they are (the engine places them so), the engine's cast points (`_cast_points`),
    gradients cast to FP32 onto the FP32 masters, the step on the masters, the masters rounded into the copy."""
    masters = copy.deepcopy(master)
    if attn is not None:
        masters.config._attn_implementation = attn
    opt = make_opt(masters.parameters())
    model, hooks = masters, []
    if dtype != torch.float32:
        model = copy.deepcopy(masters)
        for p in model.parameters():
            p.data = p.data.to(dtype)
        hooks = cast_points(model, dtype)
    pairs = list(zip(masters.parameters(), model.parameters()))
    losses: list[float] = []
    grads: dict[str, torch.Tensor] = {}
    try:
        for step, batch in enumerate(batches):
            _seed(step)  # both runs of a step draw the same numbers (PhiMoE samples its experts while training)
            loss = model(**batch).loss
            loss.backward()
            if model is not masters:
                for pm, pc in pairs:
                    pm.grad = None if pc.grad is None else pc.grad.float()
            if step == 0:
                grads = {n: p.grad.clone() for n, p in masters.named_parameters() if p.grad is not None}
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
            if model is not masters:
                model.zero_grad()
                with torch.no_grad():
                    for pm, pc in pairs:
                        pc.copy_(pm)
    finally:
        for h in hooks:
            h.remove()
    return losses, grads

def bf16_floor(master: nn.Module, batches: list, make_opt: Callable[[Any], Any],
               fp32_ref: tuple[list[float], dict]) -> tuple[float, float, str]:
    """How far rounding alone moves plain PyTorch's bf16 run: its distance from the FP32 run of the same scheme
    (same masters, batches and steps). Returns (gradient floor, loss floor, a line saying so).

    Eager against SDPA attention in bf16 was measured as the other candidate and rejected: on Llama it differs by
    0.72 (relative, one gradient), on Qwen3-MoE by 1.0, so 4x it would pass anything; and it is zero for models
    without attention (Mamba)."""
    bf16 = train_plain(master, batches, torch.bfloat16, make_opt)
    grad, loss, _ = _distance(fp32_ref, bf16)
    return grad, loss, f"bf16 vs FP32 reference {grad:.1e} / {loss:.1e}"


def _grad_errors(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> list[tuple[str, float]]:
    scale = max((g.abs().max().item() for g in ref.values()), default=0.0)
    out = []
    for name, g in ref.items():
        e = got.get(name)
        if e is None:
            out.append((name, math.inf))
            continue
        floor = max(g.abs().max().item(), 1e-2 * scale, 1e-30)
        out.append((name, (e - g).abs().max().item() / floor))
    return out


def _distance(ref: tuple[list[float], dict], got: tuple[list[float], dict]) -> tuple[float, float, str]:
    """(worst first-step gradient error as _grad_errors measures it, worst loss difference, the worst parameter)."""
    errors = _grad_errors(ref[1], got[1])
    name, grad = max(errors, key=lambda e: e[1], default=("", 0.0))
    loss = max((abs(a - b) for a, b in zip(ref[0], got[0])), default=0.0)
    return grad, loss, name
