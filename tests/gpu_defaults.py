"""The configuration a GPU user gets, run on the CPU, and the plain-PyTorch reference it is held to.

A CUDA run defaults to bf16 compute (`compute_dtype: auto`), the host update overlapped with the next forward,
and (in the recommended setup) the exact split master `host_master: hilo`. The core parity and bit-identity
tests run once in FP32 and once in this configuration (`CONFIGS`), so a bug that only the GPU's defaults
reach shows on a CPU-only CI.

The reference in bf16 is plain PyTorch with the engine's mixed-precision scheme, not an FP32 model:

- the compute copy holds every *parameter* in bf16, the round-to-nearest-even of its FP32 master (the
  engine's bf16 shadow; with hilo the "hi" half, the same bits); buffers (rotary tables) stay FP32, as the
  engine leaves them;
- forward and backward run in bf16 (HF's own upcasts inside, e.g. RMSNorm's and the loss's FP32 logits), with
  the engine's two casts besides the parameters': the first decoder layer's input to bf16 and the head's input
  to its weight's dtype (no-ops where the model's own math already gives bf16 there);
- each micro-batch's bf16 gradients are widened to FP32 and summed into FP32 gradients (the host slabs);
- clipping and AdamW act on the FP32 masters; the compute copy is refreshed from them after each step.

Tolerance (`BF16Floor`): two equally valid bf16 programs differ by their rounding points, and those
differences grow over training steps. The reference's own floor is how far it lands from itself when only its
attention kernel changes: sdpa's flash kernel against its math kernel on the CPU, which agree to ~1e-7 in FP32
(eager attention is no such pair: it treats padded query rows differently from sdpa, 11% apart in FP32). The
engine makes other choices of the same kind (its chunked head sums the head's gradient over chunks in FP32,
its embedding's gradient is scattered in FP32), so it is held to `FLOOR_FACTOR` times that floor on every
quantity compared: the per-step losses and pre-clip norms (largest difference), the first step's gradients and
the parameters' movement over the run (relative L2 over the whole model). The factor is 2: a program one floor
from the math-kernel run is at most two from the flash one (the triangle inequality). Measured on the tiny
models here (Llama, tied Qwen2, Mistral with a sliding window, 3 seeds each, 1 and 2 threads, the compiled
and the torch update kernels) the engine sits at 0.20-0.31 floors on gradients and movement, up to 1.14 on
the pre-clip norms and 1.26 on the noisiest quantity (the largest single loss difference); on the MoE
families the first step's gradients are within 1e-7 (relative) of the reference's where the head is one chunk. What it catches: a lost micro-batch (~100 floors), a 10% LR
error (~3 floors) (tests/unit/test_engine.py). What it does not separate: FP32 compute from bf16 compute (~1.1
floors at this size and length); that bf16 really computed is asserted on the streamed weights' dtype (`lag_updates`),
and the exact claims (hilo against the FP32 master, overlap on against off, resume) are bit for bit.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import pytest
import torch
from kit import train_steps

from megatrain.models.mixed_precision import cast_points

GPU_DEFAULTS = {"compute_dtype": "bfloat16", "optimizer_overlap": True, "host_master": "hilo"}
FP32 = {"compute_dtype": "float32", "optimizer_overlap": False}
CONFIGS = [pytest.param(FP32, id="fp32"), pytest.param(GPU_DEFAULTS, id="gpu-defaults")]
FLOOR_FACTOR = 2.0
OVERLAP_STALL_S = 0.005  # the layer updates lag behind the caller: every wait on them is exercised


def is_bf16(cfg: dict) -> bool:
    return cfg.get("compute_dtype") == "bfloat16"


def deepspeed_keys(mode: dict) -> dict:
    """The DeepSpeed-config keys that select `mode` (FP32: none, the face's defaults on the CPU)."""
    if not is_bf16(mode):
        return {}
    return {"bf16": {"enabled": True}, "megatrain": {k: v for k, v in mode.items() if k != "compute_dtype"}}


def lag_updates(eng, stall: float = OVERLAP_STALL_S):
    """With optimizer_overlap, make each queued layer update start late, so the caller always runs ahead;
    in the GPU's defaults, check that the engine really runs them (bf16 streamed weights, hilo, overlap)."""
    if eng.config.compute_dtype == "bfloat16" and eng.config.host_master == "hilo":
        from megatrain.costs.modes import HostMaster

        assert eng.store.master_mode is HostMaster.HILO and eng.store.layers[0].stream_source.dtype == torch.bfloat16
        assert eng.config.optimizer_overlap is not True or eng._layered is not None, "optimizer_overlap fell back"
    if eng._layered is not None:
        eng._layered.stream.stall_s = stall
    return eng


class MixedPrecisionReference:
    """Plain PyTorch with the engine's bf16 scheme, driven like an Engine (call, backward, clip_grad_norm_,
    step, zero_grad). `model` keeps the FP32 masters (its state_dict() is the reference's result); a deep
    copy with bf16 parameters computes."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.masters = model
        self.compute = copy.deepcopy(model)
        with torch.no_grad():
            for p in self.compute.parameters():  # parameters only: the rotary tables stay FP32, as in the engine
                p.data = p.data.to(torch.bfloat16)
        self.pairs = list(zip(model.parameters(), self.compute.parameters(), strict=True))
        cast_points(self.compute, torch.bfloat16)  # the engine's casts, as the parity probe's reference has them
        self.optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    def __call__(self, **batch):
        return self.compute(**batch)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        for master, comp in self.pairs:  # the bf16 gradient, widened, summed in FP32 (the host slab)
            if comp.grad is not None:
                g = comp.grad.float()
                master.grad = g if master.grad is None else master.grad.add_(g)
                comp.grad = None

    def clip_grad_norm_(self, max_norm: float) -> float:
        return float(torch.nn.utils.clip_grad_norm_(self.masters.parameters(), max_norm))

    def step(self) -> None:
        self.optimizer.step()
        with torch.no_grad():
            for master, comp in self.pairs:
                comp.copy_(master)  # round to nearest even: the shadow's (hilo's hi half's) bits

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def grads(self) -> dict[str, torch.Tensor]:
        return {n: p.grad.clone() for n, p in self.masters.named_parameters() if p.grad is not None}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.masters.state_dict()


def engine_grads(eng) -> dict[str, torch.Tensor]:
    """Every parameter's FP32 gradient as it sits in the host slabs (the layers' `.grad` are not views of
    them in every mode: hilo's parameters are copies), after everything queued has landed."""
    eng._all_grads()
    return {n: g.view(g.grad, s).clone() for n, (g, s) in eng.placement.slots_by_name().items()
            if g.grad is not None and s.offset + s.numel <= g.grad.numel()}  # a frozen parameter has no slab


def train(runner, batches: Iterable[dict], steps: int, accum: int = 1, clip: float | None = None,
          scheduler=None) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """The loop every parity test runs, for an Engine or a MixedPrecisionReference alike:
    (per-micro-batch losses, pre-clip norms, first step's gradients)."""
    first: dict[str, torch.Tensor] = {}

    def keep_first(runner, s: int) -> None:
        if s == 0:
            first.update(runner.grads() if isinstance(runner, MixedPrecisionReference) else engine_grads(runner))

    losses, norms = train_steps(runner, batches, steps, accum=accum, clip=clip, scheduler=scheduler,
                                before_clip=keep_first)
    return losses, norms, first


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], base: dict[str, torch.Tensor] | None = None) -> float:
    """||a - b|| / ||b - base|| over every tensor together (base None: ||b||)."""
    diff = sum(float((a[n].float() - b[n].float()).square().sum()) for n in b)
    ref = sum(float((b[n].float() - (base[n].float() if base is not None else 0)).square().sum()) for n in b)
    return (diff / max(ref, 1e-30)) ** 0.5


def _distances(a: tuple, b: tuple, params_a: dict | None, params_b: dict, initial: dict) -> dict[str, float]:
    """How far run `a` lands from run `b`: the largest per-step loss (and pre-clip norm) difference, the
    first step's gradients and the parameters' movement over the run as relative L2 errors over the whole
    model (one tensor's near-zero entries do not decide it). A face that reports only losses and norms (no
    first-step gradients, no parameters: `a`'s are empty / None) is compared on those."""
    (la, na, ga), (lb, nb, gb) = a, b
    out = {"loss": max(abs(x - y) for x, y in zip(la, lb, strict=True))}
    if ga:
        out["grad"] = _rel(ga, gb)
    if params_a is not None:
        out["update"] = _rel(params_a, params_b, initial)
    if nb:  # clipped runs: the pre-clip norms, step by step
        out["norm"] = max(abs(x - y) for x, y in zip(na, nb, strict=True))
    return out


@dataclass
class BF16Floor:
    """The reference's run (sdpa's flash kernel) and how far the same reference lands from it with sdpa's
    math kernel (the bf16 floor)."""

    out: tuple
    params: dict[str, torch.Tensor]
    initial: dict[str, torch.Tensor]
    floor: dict[str, float] = field(default_factory=dict)

    def distances(self, out: tuple, params: dict[str, torch.Tensor] | None) -> dict[str, float]:
        return _distances(out, self.out, params, self.params, self.initial)

    def check(self, out: tuple, params: dict[str, torch.Tensor] | None,
              factor: float = FLOOR_FACTOR) -> dict[str, float]:
        """Assert that a run is within `factor` floors of the reference on every quantity; return its distances."""
        got = self.distances(out, params)
        over = {k: (v, self.floor[k]) for k, v in got.items() if v > factor * self.floor[k]}
        assert not over, f"beyond {factor} x the reference's bf16 floor (distance, floor): {over}"
        return got


def bf16_reference(model: torch.nn.Module, batches: list[dict], steps: int, accum: int = 1,
                   clip: float | None = None,
                   optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None,
                   scheduler: Callable[[torch.optim.Optimizer], object] | None = None) -> BF16Floor:
    """Run the mixed-precision reference twice from copies of `model`, with sdpa's flash and math CPU kernels
    (in FP32 they agree to ~1e-7; in bf16 they round at other points), and return the flash run with the
    distance between the two as the floor. `optimizer`/`scheduler` build the masters' optimizer and its
    schedule (default: fused AdamW at lr 1e-3, as the engine's default optimizer)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    runs = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH):
        m = copy.deepcopy(model)
        ref = MixedPrecisionReference(m, optimizer(m) if optimizer else None)
        with sdpa_kernel([backend]):
            out = train(ref, batches, steps, accum, clip, scheduler(ref.optimizer) if scheduler else None)
        runs.append((out, {n: p.detach().clone() for n, p in m.named_parameters()}))
    (out, params), (math_out, math_params) = runs
    floor = _distances(math_out, out, math_params, params, initial)
    assert all(v > 0 for v in floor.values()), f"the two kernels agree exactly: no bf16 floor to measure ({floor})"
    return BF16Floor(out, params, initial, floor)
