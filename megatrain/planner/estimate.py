"""The performance and memory model: bytes and seconds per component, from shapes and a hardware profile.

Three backends are modelled at the same training point:
  megatrain  layers streamed through k device buffers, all state on the host (DESIGN.md),
  zero3      DeepSpeed ZeRO-3 with parameters and optimizer offloaded to the CPU,
  torch      plain PyTorch + AdamW with everything on the device (the reference).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from megatrain.metrics.flops import model_flops_per_step
from megatrain.models.presets import ModelPreset

from .hardware import GB, GIB, Hardware, _is_bf16, get_hardware
from .shapes import resolve_model

BACKENDS = ("megatrain", "zero3", "torch")
MASTERS = ("fp32", "hilo", "bf16")

# ---- Activation memory, elements per token, all linear in T (sdpa keeps attention O(T)).
# HF decoder layer under HF gradient checkpointing (the zero3/torch baselines): measured on
# transformers 5.x by tracking live tensor storages (TorchDispatchMode) through a recomputed forward +
# torch.autograd.grad of one Llama/Qwen2 layer, fitted over h, kv, intermediate and T:
# peak = 9.3 h + 2 kv + 6 I (weight grads excluded).
HF_WS_H, HF_WS_KV, HF_WS_I = 9.3, 2.0, 6.0
# The engine's own recompute + backward (megatrain), attention side and the MLP side that sequence
# tiling shrinks to one tile: the coefficients the engine's DeviceMemoryTracker measured for its
# tiled and untiled paths (FP32; engine/tiling.py), restated here since the planner may not import it.
MT_ATTN_H, MT_ATTN_KV, MT_MLP_H, MT_MLP_I = 9.0, 2.0, 2.0, 6.0
# With bf16 compute the RMSNorms upcast to fp32: ~1.5 h extra fp32 elements per token (measured as
# above, bf16 vs fp32), half on each side of the layer.
WS_H_FP32_BF16 = 1.5
# Saved by an HF forward that keeps everything (no recompute): 8.3 h + 2 kv + 4 I.
SAVED_H, SAVED_KV, SAVED_I = 8.3, 2.0, 4.0
# Offloaded boundary activations still on the device at once (the layer's input and output, the
# next input prefetched, one on its way out; measured by the engine).
OFFLOAD_IN_FLIGHT = 4
# HF's ForCausalLMLoss over full logits: measured peak (forward + backward) = T x V x (c + 12)
# bytes: the logits in compute dtype (kept by the model output) + fp32 upcast, log-softmax, gradient.
LOSS_BYTES_EXTRA = 12
# The engine's chunked loss: per chunk 3 fp32 chunk x V tensors (logits, softmax/gradient, a
# transient), the head input and its gradient (2 T h c), and the fp32 head-gradient accumulator.
CHUNK_LOGIT_COPIES = 3
# Memory-bound traffic of a layer's forward (norms, RoPE, residual adds, SiLU*up), elements read
# + written per token: an estimate from the op list, small next to the GEMMs on a GPU.
ELEM_H, ELEM_I = 20.0, 5.0
# Flash/memory-efficient attention backward recomputes the scores: 5 GEMMs vs 2 forward.
ATTN_BWD_RATIO = 2.5
# DeepSpeed's memory estimator: ZeRO-3 offload of params + optimizer needs 18 B/param (zero_init)
# times additional_buffer_factor=1.5 (deepspeed/runtime/zero/stage3.py,
# estimate_zero3_model_states_mem_needs; https://deepspeed.readthedocs.io/en/latest/memory.html).
ZERO3_BUFFER_FACTOR = 1.5
ZERO3_MAX_LIVE_PARAMS = 1e9  # stage3_max_live_parameters default
ZERO3_REDUCE_BUCKET = 5e8  # reduce_bucket_size default (elements)
PAGEABLE_LINK_FRACTION = 0.5  # assumption: pageable copies reach about half the pinned rate


@dataclass(frozen=True)
class Point:
    """One training configuration to plan."""

    model: ModelPreset
    context: int
    batch: int = 1
    grad_accum: int = 1
    dtype: str = "bfloat16"
    backend: str = "megatrain"
    num_buffers: int = 2
    offload_activations: bool | str = "auto"  # True, False or "auto" (offload only when the device is short)
    tile_tokens: int | str | None = "auto"  # MLP sequence tile; None = untiled, "auto" = chosen from the budget
    loss_chunk_tokens: int = 2048
    master: str = "fp32"  # fp32 (+ bf16 shadow in bf16 mode), hilo (exact split, no shadow), bf16 (paper's code)
    host_grad_dtype: str = "float32"
    optimizer_overlap: bool = False  # CPU AdamW layer by layer during the last backward
    grad_clip: bool = True
    gradient_checkpointing: bool = True  # zero3 / torch only: megatrain always recomputes per layer
    zero3_pin_memory: bool = True
    # True: DeepSpeed's prefetch hides each module's fetch behind compute (its best case);
    # False: fetches and gradient offload serialize with compute (its worst case)
    zero3_overlap: bool = True

    @property
    def tokens(self) -> int:  # per micro-batch
        return self.batch * self.context

    @property
    def tokens_per_step(self) -> int:
        return self.tokens * self.grad_accum

    @property
    def c(self) -> int:  # bytes per element of the compute dtype
        return 2 if _is_bf16(self.dtype) else 4


@dataclass
class Memory:
    host: dict[str, int]
    device: dict[str, int]
    unified: bool = False  # device allocations come out of host memory (CPU runs)

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    @property
    def device_total(self) -> int:
        return sum(self.device.values())

    @property
    def host_total_incl_device(self) -> int:
        return self.host_total + (self.device_total if self.unified else 0)


@dataclass
class LayerTime:
    """Seconds for one streamed decoder layer in one micro-batch."""

    fwd_compute: float
    fwd_h2d: float
    fwd_d2h: float
    fwd: float
    bwd_compute: float
    bwd_h2d: float
    bwd_d2h: float  # includes the host-side gradient accumulation on the d2h lane
    bwd: float


@dataclass
class Time:
    layer: LayerTime
    forward_s: float  # per micro-batch, all layers
    backward_s: float
    head_s: float
    fill_drain_s: float  # per micro-batch: first weight load, last gradient copy
    embed_io_s: float  # per step: embedding/head upload and gradient download
    optimizer_s: float  # CPU (megatrain, zero3) or device (torch) optimizer, as it adds to the step
    optimizer_busy_s: float  # its full run time, overlapped or not
    step_s: float
    copy_wait_s: float  # per step: time the compute stream waits on copies (the engine's copy_wait_s)
    busy_s: dict[str, float]  # per resource, over the step
    h2d_bytes: int
    d2h_bytes: int
    bottleneck: str


@dataclass
class Plan:
    point: Point
    hardware: Hardware
    memory: Memory
    time: Time
    fits: bool
    reasons: list[str]
    decisions: dict[str, Any]
    warnings: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.point.tokens_per_step / self.time.step_s

    @property
    def model_flops(self) -> float:
        m = self.point.model
        return model_flops_per_step(m.nonembed_params(), m.num_layers, m.hidden, self.point.context,
                                    self.point.tokens_per_step)

    @property
    def model_tflops(self) -> float:
        return self.model_flops / self.time.step_s / 1e12

    @property
    def mfu(self) -> float:
        return self.model_flops / self.time.step_s / self.hardware.peak_flops(self.point.dtype)

    @property
    def host_bytes_per_param(self) -> float:
        return self.memory.host_total / self.point.model.param_count()

    @property
    def host_store_bytes(self) -> int:
        """Model state on the host (the engine's host_store_bytes for megatrain)."""
        keys = ("master weights", "gradients", "adam m", "adam v", "bf16 shadow (streams)",
                "fp32 master weights", "fp32 gradients", "params (compute dtype)")
        return sum(v for k, v in self.memory.host.items() if k in keys)

    @property
    def device_weight_bytes(self) -> int:
        """Weights resident on the device (the engine's device_weight_bytes for megatrain)."""
        keys = ("layer buffers", "embedding/head/norm", "fetched layer params", "fetched embedding/head",
                "fp32 weights")
        return sum(v for k, v in self.memory.device.items() if k in keys)

    @property
    def crossover_tokens(self) -> float | None:
        """Tokens per micro-batch above which forward compute hides the weight stream (megatrain)."""
        return link_crossover_tokens(self.point, self.hardware) if self.point.backend != "torch" else None

    def to_dict(self) -> dict[str, Any]:
        p = dataclasses.asdict(self.point)
        p["model"] = self.point.model.name
        return {
            "point": p,
            "hardware": self.hardware.name,
            "memory": {"host": dict(self.memory.host), "device": dict(self.memory.device),
                       "host_total": self.memory.host_total, "device_total": self.memory.device_total,
                       "unified": self.memory.unified},
            "time": dataclasses.asdict(self.time),
            "fits": self.fits,
            "reasons": list(self.reasons),
            "decisions": dict(self.decisions),
            "warnings": list(self.warnings),
            "tokens_per_s": self.tokens_per_s,
            "model_tflops": self.model_tflops,
            "mfu": self.mfu,
            "host_bytes_per_param": self.host_bytes_per_param,
            "crossover_tokens": self.crossover_tokens,
        }

    def to_row(self) -> dict[str, Any]:
        """A flat record marked source=predicted, with the harness's results column names where a
        column means the same thing (experiments/results.py), so predicted and measured rows join
        on backend, model, seq_len, micro_batch, grad_accum and precision."""
        p, t, m, hw = self.point, self.time, self.point.model, self.hardware
        g = p.grad_accum
        measured_peak = "measured by megatrain bench" in hw.sources.get("peak_bf16_tflops", "")
        return {
            "source": "predicted",
            "hardware": hw.name,
            "status": "ok" if self.fits else "skipped",
            "reason": "" if self.fits else "; ".join(r for r in self.reasons if "DOES NOT FIT" in r),
            "backend": p.backend,
            "model": m.name,
            "family": m.family,
            "num_layers": m.num_layers,
            "hidden": m.hidden,
            "intermediate": m.intermediate,
            "heads": m.heads,
            "kv_heads": m.kv_heads,
            "vocab": m.vocab,
            "params": m.param_count(),
            "nonembed_params": m.nonembed_params(),
            "seq_len": p.context,
            "micro_batch": p.batch,
            "grad_accum": g,
            "tokens_per_step": p.tokens_per_step,
            "precision": "bf16" if p.c == 2 else "fp32",
            "recompute": True if p.backend == "megatrain" else p.gradient_checkpointing,
            "num_buffers": p.num_buffers if p.backend == "megatrain" else None,
            "offload_activations": self.decisions.get("offload_activations"),
            "tile_tokens": self.decisions.get("tile_tokens"),
            "master": p.master if p.backend == "megatrain" else None,
            "step_time_s": t.step_s,
            "tokens_per_s": self.tokens_per_s,
            "flops_per_step": self.model_flops,
            "model_tflops": self.model_tflops,
            "device_peak_tflops": hw.peak_flops(p.dtype) / 1e12,
            "peak_source": "measured" if measured_peak else "table",
            "mfu": self.mfu,
            "forward_s": (t.forward_s + t.fill_drain_s / 2) * g,
            "backward_s": (t.backward_s + t.head_s + t.fill_drain_s / 2) * g,
            "optimizer_s": t.optimizer_busy_s,
            "copy_wait_s": t.copy_wait_s,
            "breakdown_source": "predicted",
            "bottleneck": t.bottleneck,
            "peak_device_bytes": self.memory.device_total,
            "device_weight_bytes": self.device_weight_bytes,
            "host_bytes": self.memory.host_total,
            "host_store_bytes": self.host_store_bytes,
            "host_bytes_per_param": self.host_bytes_per_param,
            "streamed_weight_bytes": m.num_layers * m.layer_params() * p.c,
            "h2d_bytes_per_step": t.h2d_bytes,
            "d2h_bytes_per_step": t.d2h_bytes,
            "h2d_gbps": t.h2d_bytes / t.step_s / 1e9,
            "d2h_gbps": t.d2h_bytes / t.step_s / 1e9,
            "link_peak_h2d_gbps": hw.link_gbs_achieved,
            "link_util": t.h2d_bytes / t.step_s / 1e9 / hw.link_gbs_achieved,
            "crossover_tokens": self.crossover_tokens,
            "memory_host": json.dumps(self.memory.host, separators=(",", ":")),
            "memory_device": json.dumps(self.memory.device, separators=(",", ":")),
        }


# ------------------------------------------------------------------------------------ inputs


def make_point(model: Any, context: int, batch: int = 1, grad_accum: int = 1, dtype: str = "bfloat16",
               backend: str = "megatrain", engine_config: Any = None, **knobs: Any) -> Point:
    """Validate inputs into a Point. `engine_config` (an EngineConfig or anything with its attribute
    names) supplies num_buffers, loss_chunk_tokens, offload_activations and compute_dtype."""
    m = resolve_model(model)
    if engine_config is not None:
        dtype = getattr(engine_config, "compute_dtype", dtype)
        for k in ("num_buffers", "loss_chunk_tokens", "offload_activations"):
            if hasattr(engine_config, k):
                knobs.setdefault(k, getattr(engine_config, k))
        # size what the engine will run: no sequence tiling unless its config has the knob
        knobs.setdefault("tile_tokens", getattr(engine_config, "mlp_tile_tokens", None))
    unknown = set(knobs) - {f.name for f in dataclasses.fields(Point)}
    if unknown:
        raise ValueError(f"unknown planner setting(s) {sorted(unknown)}")
    for name, v in (("context", context), ("batch", batch), ("grad_accum", grad_accum),
                    ("num_buffers", knobs.get("num_buffers", 2)),
                    ("loss_chunk_tokens", knobs.get("loss_chunk_tokens", 2048))):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be an int >= 1")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {BACKENDS}")
    _is_bf16(dtype)  # raises on an unknown dtype
    _is_bf16(knobs.get("host_grad_dtype", "float32"))
    if knobs.get("master", "fp32") not in MASTERS:
        raise ValueError(f"master={knobs['master']!r}: use one of {MASTERS}")
    off = knobs.get("offload_activations", "auto")
    if off not in (True, False, "auto"):
        raise ValueError(f"offload_activations={off!r}: use True, False or 'auto'")
    tile = knobs.get("tile_tokens", "auto")
    if not (tile is None or tile == "auto" or (isinstance(tile, int) and not isinstance(tile, bool) and tile >= 1)):
        raise ValueError(f"tile_tokens={tile!r}: use None (untiled), 'auto' or an int >= 1")
    dtype = "bfloat16" if _is_bf16(dtype) else "float32"
    return Point(model=m, context=context, batch=batch, grad_accum=grad_accum, dtype=dtype, backend=backend, **knobs)


def _hardware(hardware: Any, link_gbs: float | None, host_memory_gib: float | None,
              device_memory_gib: float | None) -> Hardware:
    hw = get_hardware(hardware)
    changes: dict[str, Any] = {}
    if link_gbs is not None:
        changes["link_gbs_achieved"] = float(link_gbs)
    if host_memory_gib is not None:
        changes["host_memory_gib"] = float(host_memory_gib)
    if device_memory_gib is not None:
        changes["device_memory_gib"] = float(device_memory_gib)
    return hw.with_(**changes) if changes else hw


# ------------------------------------------------------------------------------------ memory


def layer_working_set_bytes(m: ModelPreset, tokens: int, c: int, tile: int | None = None,
                            engine: bool = True) -> int:
    """Peak bytes one decoder layer's recompute + backward adds beyond its input and weights (weight
    grads excluded). engine=True: megatrain's path, whose MLP side runs over `tile` tokens at a time
    when tiled (attention stays whole, O(T)); engine=False: an HF layer under gradient checkpointing."""
    kv = m.kv_heads * m.head_dim
    fp32_extra = WS_H_FP32_BF16 * m.hidden * 4 if c == 2 else 0.0
    if not engine:
        return int(tokens * ((HF_WS_H * m.hidden + HF_WS_KV * kv + HF_WS_I * m.intermediate) * c + fp32_extra))
    t = tokens if tile is None else min(tile, tokens)
    attn_side = (MT_ATTN_H * m.hidden + MT_ATTN_KV * kv) * c + fp32_extra / 2
    mlp_side = (MT_MLP_H * m.hidden + MT_MLP_I * m.intermediate) * c + fp32_extra / 2
    return int(tokens * attn_side + t * mlp_side)


def chunked_loss_bytes(m: ModelPreset, tokens: int, c: int, chunk: int) -> int:
    """Peak bytes of megatrain's head + chunked loss, forward and backward."""
    return int(2 * tokens * m.hidden * c + CHUNK_LOGIT_COPIES * min(chunk, tokens) * m.vocab * 4
               + m.vocab * m.hidden * 4)


def layer_saved_bytes(m: ModelPreset, tokens: int, c: int) -> int:
    """Bytes one HF layer's forward saves for backward when nothing is recomputed."""
    kv = m.kv_heads * m.head_dim
    fp32_extra = WS_H_FP32_BF16 * m.hidden * 4 if c == 2 else 0.0
    return int(tokens * ((SAVED_H * m.hidden + SAVED_KV * kv + SAVED_I * m.intermediate) * c + fp32_extra))


def _master_bytes(p: Point) -> tuple[int, int]:
    """(host master bytes/param, bf16 shadow bytes/param)."""
    if p.master == "bf16":
        return 2, 0
    if p.master == "hilo":
        return 4, 0  # the hi half is the bf16 copy that streams
    return 4, (2 if p.c == 2 else 0)


def megatrain_memory(p: Point, hw: Hardware, offload: bool, tile: int | None) -> Memory:
    m, c, T = p.model, p.c, p.tokens
    P, PL, L, h = m.param_count(), m.layer_params(), m.num_layers, m.hidden
    resident = m.embed_params() + h  # embedding, LM head, final norm
    mb, shadow = _master_bytes(p)
    gb = 2 if _is_bf16(p.host_grad_dtype) else 4
    host = {
        "master weights": P * mb,
        "gradients": P * gb,
        "adam m": P * 4,
        "adam v": P * 4,
        "bf16 shadow (streams)": L * PL * shadow,  # only layers stream; resident params convert once
        "pinned grad staging": 2 * PL * c,
        "offloaded activations": L * T * h * c if offload else 0,
        "optimizer temporaries": 2 * 4 * max(PL, m.vocab * h),
        "runtime": int(hw.host_reserved_gib * GIB),
    }
    k = p.num_buffers
    device = {
        "layer buffers": k * PL * c,
        "layer grad buffers": (2 if k >= 2 else 1) * PL * c,
        "embedding/head/norm": resident * c,
        "embedding/head grads": resident * c,
        "boundary activations": (min(L, OFFLOAD_IN_FLIGHT) if offload else L) * T * h * c,
        # the head/loss and a layer's backward never run at once: the larger of the two
        "working set (layer or loss)": max(
            layer_working_set_bytes(m, T, c, tile), chunked_loss_bytes(m, T, c, p.loss_chunk_tokens)),
        "runtime": 0 if hw.unified_memory else int(hw.device_reserved_gib * GIB),
    }
    return Memory(host, device, hw.unified_memory)


def _hf_activations(p: Point) -> dict[str, int]:
    """Activations of an HF model on the device: boundary checkpoints (or everything, without
    checkpointing), the logits the output keeps, and the larger of a layer's recompute+backward and
    the loss's fp32 transients (they are not live at once)."""
    m, c, T, L, h = p.model, p.c, p.tokens, p.model.num_layers, p.model.hidden
    logits = T * m.vocab * c
    loss = T * m.vocab * LOSS_BYTES_EXTRA
    if p.gradient_checkpointing:
        return {"boundary activations": L * T * h * c, "full logits": logits,
                "working set (layer or loss)": max(layer_working_set_bytes(m, T, c, engine=False), loss)}
    return {"saved activations": L * layer_saved_bytes(m, T, c), "full logits": logits, "loss transients": loss}


def zero3_memory(p: Point, hw: Hardware) -> Memory:
    m, c = p.model, p.c
    P, PL, h = m.param_count(), m.layer_params(), m.hidden
    states = {"fp32 master weights": P * 4, "fp32 gradients": P * 4, "adam m": P * 4, "adam v": P * 4,
              "params (compute dtype)": P * c}
    host = dict(states)
    host["deepspeed buffers (x1.5)"] = int(sum(states.values()) * (ZERO3_BUFFER_FACTOR - 1))
    host["runtime"] = int(hw.host_reserved_gib * GIB)
    device = {
        "fetched layer params": int(min(ZERO3_MAX_LIVE_PARAMS, 2 * PL) * c),
        "fetched embedding/head": m.vocab * h * c,
        "grad reduce bucket": int(min(ZERO3_REDUCE_BUCKET, P) * c),
        **_hf_activations(p),
        "runtime": 0 if hw.unified_memory else int(hw.device_reserved_gib * GIB),
    }
    return Memory(host, device, hw.unified_memory)


def torch_memory(p: Point, hw: Hardware) -> Memory:
    m, c = p.model, p.c
    P = m.param_count()
    device = {
        "fp32 weights": P * 4,
        "fp32 gradients": P * 4,
        "adam m + v": P * 8,
        "bf16 weight casts (autocast)": m.layer_params() * 2 * 2 if c == 2 else 0,
        **_hf_activations(p),
        "runtime": 0 if hw.unified_memory else int(hw.device_reserved_gib * GIB),
    }
    host = {"runtime": int(hw.host_reserved_gib * GIB)}
    return Memory(host, device, hw.unified_memory)


def check_fit(mem: Memory, hw: Hardware, host_avail: int | None = None,
              device_avail: int | None = None) -> tuple[bool, list[str]]:
    """Whether it fits, and one line per memory pool (needed vs available, largest components)."""
    host_cap = hw.host_bytes if host_avail is None else host_avail
    dev_cap = hw.device_bytes if device_avail is None else device_avail
    lines, ok = [], True
    if mem.unified:
        need = mem.host_total_incl_device
        good = need <= host_cap
        ok &= good
        lines.append(_fit_line("host (device shares it)", need, host_cap, {**mem.host, **{
            f"device: {k}": v for k, v in mem.device.items()}}, good))
    else:
        for pool, need, cap, comps in (("host", mem.host_total, host_cap, mem.host),
                                       ("device", mem.device_total, dev_cap, mem.device)):
            good = need <= cap
            ok &= good
            lines.append(_fit_line(pool, need, cap, comps, good))
    return ok, lines


def _fit_line(pool: str, need: int, cap: int, comps: dict[str, int], good: bool) -> str:
    top = sorted(((v, k) for k, v in comps.items() if v > 0), reverse=True)[:6]
    parts = ", ".join(f"{k} {fmt_bytes(v)}" for v, k in top)
    verdict = "fits" if good else "DOES NOT FIT"
    return f"{pool}: needs {fmt_bytes(need)} of {fmt_bytes(cap)} available, {verdict} ({parts})"


def fmt_bytes(n: float) -> str:
    n = float(n)
    for unit, div in (("TiB", GIB * 1024), ("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


# ------------------------------------------------------------------------------------ time


def _layer_compute(p: Point, hw: Hardware) -> tuple[float, float, float]:
    """(forward, recompute, backward-only) seconds of one decoder layer for one micro-batch."""
    m, T, c = p.model, p.tokens, p.c
    R = hw.sustained_flops(p.dtype)
    Bd = hw.device_memory_bw_gbs * GB
    lin = 2.0 * m.layer_params() * T
    attn = 2.0 * m.hidden * p.context * T  # causal QK^T + AV: 4 h s T x 1/2
    elem = T * (ELEM_H * m.hidden + ELEM_I * m.intermediate) * c / Bd
    fwd = (lin + attn) / R + elem
    bwd_only = (2 * lin + ATTN_BWD_RATIO * attn) / R + elem
    return fwd, fwd, bwd_only


def _head_compute(p: Point, hw: Hardware, recompute_logits: bool) -> float:
    """LM head + cross-entropy for one micro-batch. The chunked loss recomputes each chunk's logits
    in backward (8 V h T FLOPs); HF's keeps them (6 V h T)."""
    m, T, c = p.model, p.tokens, p.c
    R = hw.sustained_flops(p.dtype)
    Bd = hw.device_memory_bw_gbs * GB
    gemm = (8.0 if recompute_logits else 6.0) * m.vocab * m.hidden * T
    # softmax/CE traffic over every logit, forward and backward
    elem = 2 * T * m.vocab * (c + LOSS_BYTES_EXTRA) / Bd
    return gemm / R + elem


def _optimizer_bytes_per_param(master: int, grad: int, shadow: int, clip: bool) -> int:
    # read+write master, m, v; read grad; write the streamed copy; zero the grad; read it for clipping
    return 2 * master + 16 + grad + shadow + grad + (grad if clip else 0)


def _host_accum_bytes(p: Point) -> float:
    """Average host bytes per layer-parameter per micro-batch to add a device gradient into the
    host gradient (the first micro-batch lands in place when the dtypes match)."""
    gb = 2 if _is_bf16(p.host_grad_dtype) else 4
    first = 0 if gb == p.c else p.c + gb
    rest = p.c + 2 * gb
    return (first + (p.grad_accum - 1) * rest) / p.grad_accum


def megatrain_time(p: Point, hw: Hardware, offload: bool) -> Time:
    m, c, T, L, k = p.model, p.c, p.tokens, p.model.num_layers, p.num_buffers
    PL, h = m.layer_params(), m.hidden
    Bl, Bh = hw.link_bps, hw.host_bw_bps
    fwd_c, rec_c, bwd_only = _layer_compute(p, hw)
    bwd_c = rec_c + bwd_only
    w = PL * c / Bl
    act = T * h * c / Bl if offload else 0.0
    accum = PL * _host_accum_bytes(p) / Bh
    f_h2d, f_d2h = w, act
    b_h2d, b_d2h = w + act, PL * c / Bl + accum
    if k >= 2:
        f = max(fwd_c, f_h2d, f_d2h)
        b_stream = max(bwd_c, b_h2d, b_d2h)
        b_res = max(bwd_c, act, b_d2h)
    else:
        f = fwd_c + f_h2d + f_d2h
        b_stream = bwd_c + b_h2d + b_d2h
        b_res = bwd_c + act + b_d2h
    n_res = min(k, L)  # layers still on the device at the forward/backward turn
    forward = L * f
    backward = (L - n_res) * b_stream + n_res * b_res
    head = _head_compute(p, hw, recompute_logits=True)
    fill_drain = w + b_d2h
    g = p.grad_accum
    resident = m.embed_params() + h
    embed_io = 2 * resident * c / Bl  # upload after the optimizer, gradients down at the end
    mb, shadow = _master_bytes(p)
    gb = 2 if _is_bf16(p.host_grad_dtype) else 4
    per_param = _optimizer_bytes_per_param(mb, gb, shadow, p.grad_clip)
    opt_busy = m.param_count() * per_param / hw.optimizer_bps
    micro = fill_drain + forward + head + backward
    if p.optimizer_overlap:
        # layer groups update as their last gradient lands; the embedding/head group and the final
        # layer's update remain after backward
        opt_layers = L * PL * per_param / hw.optimizer_bps
        last_bwd = max(backward, opt_layers)
        opt_tail = (m.param_count() - L * PL + PL) * per_param / hw.optimizer_bps
        step = (g - 1) * micro + (fill_drain + forward + head + last_bwd) + embed_io + opt_tail
        opt_added = step - g * micro - embed_io
    else:
        step = g * micro + embed_io + opt_busy
        opt_added = opt_busy
    h2d_bytes = g * ((2 * L - n_res) * PL * c + (L * T * h * c if offload else 0)) + resident * c
    d2h_bytes = g * (L * PL * c + (L * T * h * c if offload else 0)) + resident * c
    busy = {
        "compute": g * (L * (fwd_c + bwd_c) + head),
        "link h2d": h2d_bytes / Bl,
        "link d2h": d2h_bytes / Bl + g * L * accum,
        "host optimizer": opt_busy,
    }
    wait = g * (L * (f - fwd_c) + (L - n_res) * (b_stream - bwd_c) + n_res * (b_res - bwd_c) + fill_drain)
    layer = LayerTime(fwd_c, f_h2d, f_d2h, f, bwd_c, b_h2d, b_d2h, b_stream)
    return Time(layer, forward, backward, head, fill_drain, embed_io, opt_added, opt_busy, step, wait, busy,
                int(h2d_bytes), int(d2h_bytes), _bottleneck(busy, p.optimizer_overlap))


def zero3_time(p: Point, hw: Hardware) -> Time:
    m, c, L = p.model, p.c, p.model.num_layers
    PL, h = m.layer_params(), m.hidden
    Bl = hw.link_bps * (1.0 if p.zero3_pin_memory else PAGEABLE_LINK_FRACTION)
    Bh = hw.host_bw_bps
    fwd_c, rec_c, bwd_only = _layer_compute(p, hw)
    fetch = PL * c / Bl  # each module's params gathered from the host before it runs
    accum = PL * _host_accum_bytes(p) / Bh
    grad_out = PL * c / Bl + accum
    # DeepSpeed prefetches the next modules while one runs; the recompute of a checkpointed layer
    # fetches its params again, and so does its backward.
    over = max if p.zero3_overlap else (lambda *xs: sum(xs))
    f = over(fwd_c, fetch)
    if p.gradient_checkpointing:
        b = over(rec_c, fetch) + over(bwd_only, fetch, grad_out)
        fetches = 3
        bwd_c = rec_c + bwd_only
    else:
        b = over(bwd_only, fetch, grad_out)
        fetches = 2
        bwd_c = bwd_only
    forward, backward = L * f, L * b
    emb = m.vocab * h * c  # embedding and head are modules too: fetched forward and backward
    n_big = 1 if m.tie_embeddings else 2
    head_fetch = 2 * n_big * emb / Bl
    head = over(_head_compute(p, hw, recompute_logits=False), head_fetch)
    fill_drain = fetch + grad_out
    g = p.grad_accum
    per_param = _optimizer_bytes_per_param(4, 4, c, p.grad_clip)  # DeepSpeed CPUAdam also writes the param copy
    opt = m.param_count() * per_param / Bh
    micro = fill_drain + forward + head + backward
    step = g * micro + opt
    h2d_bytes = g * (fetches * L * PL * c + 2 * n_big * emb)
    d2h_bytes = g * (L * PL + m.embed_params()) * c
    busy = {
        "compute": g * (L * (fwd_c + bwd_c) + _head_compute(p, hw, recompute_logits=False)),
        "link h2d": h2d_bytes / Bl,
        "link d2h": d2h_bytes / Bl + g * L * accum,
        "host optimizer": opt,
    }
    wait = g * (forward + backward + head + fill_drain - L * (fwd_c + bwd_c) - _head_compute(p, hw, False))
    layer = LayerTime(fwd_c, fetch, 0.0, f, bwd_c, fetch * (fetches - 1), grad_out, b)
    return Time(layer, forward, backward, head, fill_drain, 0.0, opt, opt, step, wait, busy,
                int(h2d_bytes), int(d2h_bytes), _bottleneck(busy, False))


def torch_time(p: Point, hw: Hardware) -> Time:
    m, L = p.model, p.model.num_layers
    fwd_c, rec_c, bwd_only = _layer_compute(p, hw)
    bwd_c = bwd_only + (rec_c if p.gradient_checkpointing else 0.0)
    head = _head_compute(p, hw, recompute_logits=False)
    per_param = _optimizer_bytes_per_param(4, 4, 0, p.grad_clip)
    bw = hw.optimizer_bps if hw.unified_memory else hw.device_memory_bw_gbs * GB
    opt = m.param_count() * per_param / bw
    micro = L * (fwd_c + bwd_c) + head
    step = p.grad_accum * micro + opt
    busy = {"compute": p.grad_accum * micro, "link h2d": 0.0, "link d2h": 0.0, "device optimizer": opt}
    layer = LayerTime(fwd_c, 0.0, 0.0, fwd_c, bwd_c, 0.0, 0.0, bwd_c)
    return Time(layer, L * fwd_c, L * bwd_c, head, 0.0, 0.0, opt, opt, step, 0.0, busy, 0, 0,
                _bottleneck(busy, False))


def _bottleneck(busy: dict[str, float], opt_overlapped: bool) -> str:
    compute = busy["compute"]
    link = max(busy["link h2d"], busy["link d2h"])
    opt = busy.get("host optimizer", busy.get("device optimizer", 0.0))
    cands = {"compute": compute, "link": link, "optimizer": opt}
    if opt_overlapped:
        cands["optimizer"] = opt if opt > compute else 0.0
    return max(cands, key=lambda k: cands[k])


def link_crossover_tokens(p: Point, hw: Hardware) -> float:
    """Tokens per micro-batch at which a layer's forward compute equals its weight transfer
    (N = Phi / B for bf16 weights, 2 Phi / B for fp32, attention and elementwise included):
    below it the link is the bottleneck, above it compute is."""
    fwd_c, _, _ = _layer_compute(p, hw)
    per_token = fwd_c / p.tokens  # linear in T at fixed context
    return p.model.layer_params() * p.c / hw.link_bps / per_token


def crossover_closed_form(hw: Hardware, dtype: str) -> float:
    """Phi / B for bf16 weights (2 Phi / B for fp32): GEMM-only forward, sustained rate, achieved link."""
    c = 2 if _is_bf16(dtype) else 4
    return c * hw.sustained_flops(dtype) / (2 * hw.link_bps)


# ------------------------------------------------------------------------------------ plan


def _tile_candidates(tokens: int) -> list[int]:
    tiles, t = [], 1 << 16
    while t >= 1024:
        if t < tokens:
            tiles.append(t)
        t //= 2
    return tiles


def plan(model: Any, context: int, batch: int = 1, grad_accum: int = 1, dtype: str = "bfloat16",
         hardware: str | Hardware | dict = "h200-pcie", backend: str = "megatrain", *,
         engine_config: Any = None, link_gbs: float | None = None, host_memory_gib: float | None = None,
         device_memory_gib: float | None = None, **knobs: Any) -> Plan:
    """Predict memory per component, step time, throughput and fit for one training point.

    knobs: num_buffers, offload_activations (True/False/'auto'), tile_tokens (None/'auto'/int),
    loss_chunk_tokens, master ('fp32'/'hilo'/'bf16'), host_grad_dtype, optimizer_overlap,
    grad_clip, gradient_checkpointing (zero3/torch), zero3_pin_memory.
    link_gbs / host_memory_gib / device_memory_gib override the profile (e.g. an emulated link).
    """
    p = make_point(model, context, batch, grad_accum, dtype, backend, engine_config, **knobs)
    if engine_config is not None:
        if link_gbs is None:
            link_gbs = getattr(engine_config, "link_gbps", None)  # the emulated link on CPU
        budget = getattr(engine_config, "device_budget_bytes", None)
        if device_memory_gib is None and budget:
            device_memory_gib = budget / GIB  # what the engine's "auto" plans against
    hw = _hardware(hardware, link_gbs, host_memory_gib, device_memory_gib)
    return plan_point(p, hw)


def plan_point(p: Point, hw: Hardware, host_avail: int | None = None, device_avail: int | None = None) -> Plan:
    warnings = []
    if p.context > p.model.max_positions:
        warnings.append(f"context {p.context} exceeds the model's max_position_embeddings "
                        f"{p.model.max_positions}: the engine refuses it unless RoPE is extended")
    if p.backend == "megatrain" and p.optimizer_overlap and hw.unified_memory:
        warnings.append("on a CPU 'device' the overlapped optimizer competes with compute for the same cores")
    decisions: dict[str, Any] = {}
    if p.backend == "megatrain":
        offs = [False, True] if p.offload_activations == "auto" else [bool(p.offload_activations)]
        if p.tile_tokens == "auto":
            tiles: list[int | None] = [None, *_tile_candidates(p.tokens)]
        else:
            tiles = [p.tile_tokens]  # type: ignore[list-item]
        # Preference order: resident activations before offloaded (offload costs link time), untiled
        # before tiled, larger tiles before smaller. Take the first that fits everywhere; failing that,
        # the first whose device side fits (the host is then what does not fit, whatever the choice);
        # failing that, the most frugal.
        cands = [(off, tile) for off in offs for tile in tiles]
        dev_cap = hw.device_bytes if device_avail is None else device_avail
        chosen = None
        device_ok = None
        for off, tile in cands:
            mem = megatrain_memory(p, hw, off, tile)
            ok, reasons = check_fit(mem, hw, host_avail, device_avail)
            if ok:
                chosen = (off, tile, mem, ok, reasons)
                break
            if device_ok is None and not hw.unified_memory and mem.device_total <= dev_cap:
                device_ok = (off, tile, mem, ok, reasons)
        if chosen is None:
            if device_ok is not None:
                chosen = device_ok
            else:
                off, tile = cands[-1]
                mem = megatrain_memory(p, hw, off, tile)
                chosen = (off, tile, mem, *check_fit(mem, hw, host_avail, device_avail))
        off, tile, mem, ok, reasons = chosen
        decisions = {"offload_activations": off, "tile_tokens": tile}
        t = megatrain_time(p, hw, off)
    elif p.backend == "zero3":
        mem = zero3_memory(p, hw)
        ok, reasons = check_fit(mem, hw, host_avail, device_avail)
        t = zero3_time(p, hw)
        decisions = {"gradient_checkpointing": p.gradient_checkpointing}
    else:
        mem = torch_memory(p, hw)
        ok, reasons = check_fit(mem, hw, host_avail, device_avail)
        t = torch_time(p, hw)
        decisions = {"gradient_checkpointing": p.gradient_checkpointing}
    return Plan(p, hw, mem, t, ok, reasons, decisions, warnings)


def with_point(p: Point, **changes: Any) -> Point:
    return dataclasses.replace(p, **changes)


def ceil_div(a: float, b: float) -> int:
    return int(math.ceil(a / b))
