"""`plan --trainable`: what partial training costs, priced from the full plan of the same point.

The engine trains only what the user leaves trainable (docs/ENGINE_API.md "Part of a model"): a frozen parameter
has no gradient slab, no Adam state, no D2H of its gradient and no host update; its host copy is its weights only,
as loaded (bf16 in bf16 compute, FP32 otherwise): the frozen layers' and the embedding's, head's and norms' alike, as
the engine holds them (engine/host/codec.py LoadedBf16, FrozenTail; tests/unit/test_lora_resident.py measures the
two against each other). Below the lowest layer with a trainable parameter there is no
backward and no recompute; a frozen layer above a trainable one runs only its input-gradient GEMMs (its recompute
and its data-gradient, the weight-gradient third of a recomputed backward dropped). LoRA adapters (PEFT's A r x
d_in and B d_out x r on each targeted linear) train on the device, their weights, gradients and Adam state
resident: they are small.

Three forms (`parse_trainable`): a fraction F of the decoder layers (the top round(F x L), at least one), `top:K`
(the top K layers) and `lora:R` (rank R on q_proj and v_proj of every layer, PEFT's default targets). In every form
the embedding and the head stay frozen. The trainable layers' host state is priced at the full plan's model-state
bytes per parameter (the host mode it chose: 18 B with the FP32 master in bf16 compute, about 14 with hilo and
bf16 slabs), a conservative price where so little trains that a faster mode would fit. The step is the full plan's parts, each scaled by what remains of it (forward unchanged, the
backward layer by layer, the host update and the gradients' drain by the trainable share), so the full plan's
overlaps carry over; the head's backward is kept whole (its input gradient is still needed).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from .memory import fmt_bytes
from .prediction import Plan
from .summary import headline_step_s, host_after_spill

GIB = 2**30
ACCEPTED = "a fraction of the decoder layers (0.25: the top quarter), top:K (the top K layers) or lora:R (rank R)"
LORA_TARGETS = ("q_proj", "v_proj")  # PEFT's default targets for Llama-style attention


@dataclass(frozen=True)
class Trainable:
    """What trains: kind "layers" (the top `layers` decoder layers) or "lora" (rank `rank` adapters)."""

    text: str
    kind: str
    layers: int = 0
    rank: int = 0


def parse_trainable(text: str, num_layers: int) -> Trainable:
    """`--trainable`'s value for a model of `num_layers` decoder layers; ValueError naming it and the forms."""
    raw = str(text).strip()
    bad = f"--trainable {text!r}: expected {ACCEPTED}"
    head, sep, tail = raw.partition(":")
    if sep:
        try:
            n = int(tail)
        except ValueError:
            raise ValueError(bad) from None
        if head == "top":
            if not 1 <= n <= num_layers:
                raise ValueError(f"--trainable {text!r}: K must be 1 to {num_layers} (the model's decoder layers)")
            return Trainable(raw, "layers", layers=n)
        if head == "lora":
            if n < 1:
                raise ValueError(f"--trainable {text!r}: the LoRA rank must be at least 1 (e.g. lora:8)")
            return Trainable(raw, "lora", rank=n)
        raise ValueError(bad)
    try:
        frac = float(raw)
    except ValueError:
        raise ValueError(bad) from None
    if not 0 < frac <= 1 or math.isnan(frac):
        raise ValueError(f"--trainable {text!r}: a fraction must be in (0, 1]; or use top:K or lora:R")
    return Trainable(raw, "layers", layers=max(1, round(frac * num_layers)))


def lora_params(model: Any, rank: int) -> int:
    """PEFT's adapter parameters for rank `rank` on q_proj and v_proj of every layer: r x (d_in + d_out) each."""
    q_out, v_out = model.heads * model.head_dim, model.kv_heads * model.head_dim
    return model.num_layers * rank * ((model.hidden + q_out) + (model.hidden + v_out))


@dataclass
class PartialPlan:
    """The partial-training prediction beside the full plan's (bytes, seconds per optimizer step)."""

    trainable: str
    trainable_params: int  # held on the host (the trainable layers')
    adapter_params: int  # LoRA's, resident on the device
    frozen_params: int
    backward_layers: int  # decoder layers that run a backward (from the lowest trainable one up)
    host_bytes: int
    host_store_bytes: int  # model state: frozen weights + the trainable layers' state
    full_host_bytes: int  # as the first screen gives them: after the full plan's NVMe spill, its step with the tier
    h2d_bytes: int
    d2h_bytes: int
    full_h2d_bytes: int
    full_d2h_bytes: int
    step_s: float
    full_step_s: float
    device_bytes: int
    host_capacity: int
    device_capacity: int

    @property
    def fits(self) -> bool:
        return self.host_bytes <= self.host_capacity and self.device_bytes <= self.device_capacity

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "fits": self.fits}

    def lines(self) -> list[str]:
        what = (f"{self.adapter_params / 1e6:,.1f}M adapter parameters (resident on the device)" if self.adapter_params
                else f"{self.trainable_params / 1e9:,.2f}G parameters")
        return [
            f"  trainable {self.trainable} (predicted): {what}, {self.frozen_params / 1e9:,.1f}G frozen; "
            f"backward through {self.backward_layers} layers",
            f"    host {fmt_bytes(self.host_bytes)} (full: {fmt_bytes(self.full_host_bytes)}), step "
            f"{self.step_s:.2f} s (full: {self.full_step_s:.2f} s), link h2d {self.h2d_bytes / 1e9:,.0f} GB + d2h "
            f"{self.d2h_bytes / 1e9:,.0f} GB per step (full: {self.full_h2d_bytes / 1e9:,.0f} + "
            f"{self.full_d2h_bytes / 1e9:,.0f}); fits: {'yes' if self.fits else 'no'}"
        ]


def plan_partial(pl: Plan, spec: str | Trainable) -> PartialPlan:
    """The partial-training prediction of `pl`'s point (a megatrain plan of one GPU)."""
    p, t, hw = pl.point, pl.time, pl.hardware
    if p.backend != "megatrain":
        raise ValueError(f"--trainable prices MegaTrain's partial training; drop it with --backend {p.backend}")
    m = p.model
    L = m.num_layers
    tr = spec if isinstance(spec, Trainable) else parse_trainable(spec, L)
    sizes = m.layer_sizes()
    all_params = m.param_count()
    bf16 = p.dtype == "bfloat16"
    if tr.kind == "lora":
        trainable_layers, backward_layers = 0, L  # every layer's input gradient reaches the lowest adapters
        held = 0
        adapters = lora_params(m, tr.rank)
    else:
        trainable_layers = backward_layers = tr.layers
        held = sum(sizes[L - tr.layers:])
        adapters = 0
    frozen = all_params - held
    # host: frozen weights as loaded; the trainable layers as the full plan's host mode holds every parameter
    store = frozen * (2 if bf16 else 4) + int(held * pl.host_store_bytes / all_params)
    share = held / all_params
    rollback = pl.memory.host.get("speculative rollback copy", 0)
    other = pl.memory.host_total - pl.host_store_bytes - rollback
    host = store + other + int(rollback * share)
    # link: each streamed layer crosses once for the forward and once more if it runs a backward; gradients come
    # back only for the trainable layers (the adapters' stay on the device)
    streamed = max(1, L - (t.residency.weights if t.residency is not None else 0))
    bwd_streamed = min(streamed, backward_layers)
    h2d = int(t.h2d_bytes * (streamed + bwd_streamed) / (2 * streamed))
    d2h = int(t.d2h_bytes * held / max(1, sum(sizes)))
    # step: the backward layer by layer (a trainable layer's whole, a frozen one above a trainable one without its
    # weight-gradient GEMMs, none below), the update and the drain by the trainable share
    lt = t.layer
    frozen_bwd = max(lt.bwd_compute - lt.fwd_compute, lt.bwd_h2d)
    bwd_units = trainable_layers * lt.bwd + (backward_layers - trainable_layers) * frozen_bwd
    backward = t.backward_s * bwd_units / (L * lt.bwd) if lt.bwd else 0.0
    adapter_s = 6 * adapters * p.tokens_per_step / hw.sustained_flops(p.dtype)
    per_mb = p.grad_accum * (t.forward_s + t.head_s)
    full = per_mb + p.grad_accum * t.backward_s + t.fill_drain_s + t.embed_io_s + t.optimizer_s
    partial = (per_mb + p.grad_accum * backward + t.fill_drain_s * share + t.embed_io_s + t.optimizer_s * share
               + adapter_s)
    step = t.step_s * partial / full  # the full plan's overlaps carry over
    # device: the adapters' FP32 master, gradient and Adam m and v, and their compute copy
    device = pl.memory.device_total + adapters * (16 + (2 if bf16 else 0))
    return PartialPlan(
        trainable=tr.text, trainable_params=held, adapter_params=adapters, frozen_params=frozen,
        backward_layers=backward_layers, host_bytes=host, host_store_bytes=store,
        full_host_bytes=host_after_spill(pl), h2d_bytes=h2d, d2h_bytes=d2h, full_h2d_bytes=t.h2d_bytes,
        full_d2h_bytes=t.d2h_bytes, step_s=step, full_step_s=headline_step_s(pl), device_bytes=device,
        host_capacity=hw.host_bytes, device_capacity=hw.device_bytes)  # the totals include the runtimes' reserve
