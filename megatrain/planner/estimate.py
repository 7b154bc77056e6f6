"""The performance and memory model: bytes and seconds per component, from shapes and a hardware profile.

Three backends are modelled at the same training point:
  megatrain  layers streamed through k device buffers, all state on the host (docs/DESIGN.md),
  zero3      DeepSpeed ZeRO-3 (or ZeRO-2) with parameters and optimizer offloaded to the CPU (zero3_model.py),
  torch      plain PyTorch + AdamW with everything on the device (the reference).
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

from megatrain.metrics.flops import model_flops_per_step
from megatrain.models.presets import ModelPreset

from ..costs import memory as memory_model
from ..costs import pinning
from ..costs.modes import GRAD_BYTES, MASTER_BYTES, SHADOW_BYTES, GradSlab, HostMaster
from .hardware import GB, GIB, Hardware, _is_bf16, get_hardware
from .shapes import resolve_model
from .zero3_model import PassCost, Step, Submodule, decoder_layer_submodules, offload_tuning, run_pass

BACKENDS = ("megatrain", "zero3", "torch")
MASTERS = ("fp32", "hilo", "bf16")

# ---- Activation memory, elements per token, all linear in T (sdpa keeps attention O(T)).
# HF decoder layer under HF gradient checkpointing (the zero3/torch baselines): measured on
# transformers 5.x by tracking live tensor storages (TorchDispatchMode) through a recomputed forward +
# torch.autograd.grad of one Llama/Qwen2 layer, fitted over h, kv, intermediate and T:
# peak = 9.3 h + 2 kv + 6 I (weight grads excluded).
HF_WS_H, HF_WS_KV, HF_WS_I = 9.3, 2.0, 6.0
# With bf16 compute the RMSNorms upcast to fp32: ~1.5 h extra fp32 elements per token (measured as
# above, bf16 vs fp32), half on each side of the layer.
WS_H_FP32_BF16 = 1.5
# Saved by an HF forward that keeps everything (no recompute): 8.3 h + 2 kv + 4 I.
SAVED_H, SAVED_KV, SAVED_I = 8.3, 2.0, 4.0
# HF's ForCausalLMLoss over full logits: measured peak (forward + backward) = T x V x (c + 12)
# bytes: the logits in compute dtype (kept by the model output) + fp32 upcast, log-softmax, gradient.
LOSS_BYTES_EXTRA = 12
# Memory-bound traffic of a layer's forward (norms, RoPE, residual adds, SiLU*up), elements read
# + written per token: an estimate from the op list, small next to the GEMMs on a GPU.
ELEM_H, ELEM_I = 20.0, 5.0
# Flash/memory-efficient attention backward recomputes the scores: 5 GEMMs vs 2 forward.
ATTN_BWD_RATIO = 2.5
ZERO3_MAX_LIVE_PARAMS = 1e9  # stage3_max_live_parameters (DeepSpeed's default and the documented tuning)
# Host memory DeepSpeed's own runtime adds (its imports, JIT-built ops, the gloo process group):
# measured as the peak-RSS excess over the modelled states of the smallest quick-sweep point
# (zero3/tiny, 0.1M parameters, results/quick); the larger points are the held-out check.
ZERO3_RUNTIME_BYTES = 73 * 2**20
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
    mlp_tile_tokens: int | str | None = "auto"  # MLP sequence tile; None = untiled, "auto" = chosen from the budget
    loss_chunk_tokens: int | str = "auto"  # head/loss chunk; "auto": the engine's policy chooses it
    # what the engine's "auto" plans against (EngineConfig.device_budget_bytes); None = as the engine
    # does: the GPU's memory, no limit on a CPU "device"
    device_budget_bytes: int | None = None
    # The host-memory modes, as EngineConfig names them (megatrain/modes.py): master = host_master
    master: str = "fp32"  # fp32 (+ bf16 shadow in bf16 mode), hilo (exact split, no shadow), bf16 (paper's code)
    host_grad_dtype: str = "float32"
    optimizer_in_backward: bool = False  # each layer's AdamW during backward: no layer gradient slab
    optimizer_overlap: bool = False  # host AdamW layer by layer behind the next forward (EngineConfig)
    grad_clip: bool = True
    gradient_checkpointing: bool = True  # zero3 / torch only: megatrain always recomputes per layer
    zero3_pin_memory: bool = True
    # True: DeepSpeed's prefetch overlaps fetches with compute as far as its lookahead allows;
    # False: fetches, hooks and gradient offload serialize with compute (its worst case)
    zero3_overlap: bool = True
    # 3: ZeRO-3 offload (parameters fetched per submodule); 2: ZeRO-2 offload (ZeRO-Offload: compute-dtype
    # parameters resident on the device, gradients and optimizer on the host)
    zero_stage: int = 3
    # DeepSpeed sizes in elements; None: the zero3 backend's documented tuning from the hidden size
    zero3_prefetch_bucket: int | None = None
    zero3_persistence_threshold: int | None = None
    zero3_reduce_bucket: int | None = None

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
    shared: int = 0  # bytes listed in both pools because they are one allocation (aliased on a CPU device)
    pinned: int = 0  # the share of the host bytes that is page-locked (engine/pin_model.py, page-exact)

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    @property
    def device_total(self) -> int:
        return sum(self.device.values())

    @property
    def host_total_incl_device(self) -> int:
        return self.host_total + (self.device_total - self.shared if self.unified else 0)


@dataclass(frozen=True)
class LongContext:
    """The engine's own per-batch device plan for a megatrain point (engine/memory_model.py's
    LongContextPolicy, run on the preset's shapes), with its parts, for the long-context breakdown."""

    offload: bool  # boundary activations in host memory
    tile: int | None  # MLP sequence tile (None: untiled)
    kept_boundaries: int  # boundary activations on the device at once (resident, or in flight)
    boundary_bytes: int  # all of them
    layer_working_bytes: int  # one layer's (tiled) recompute + backward, its weight gradients included
    loss_workspace_bytes: int  # head + chunked loss, forward and backward
    loss_chunk: int  # tokens per head/loss chunk (the policy's choice under "auto")
    resident_weight_bytes: int  # layer buffers + embedding/head/norm
    peak_bytes: int  # the policy's predicted device peak (the engine's predicted_peak_device_bytes)
    budget: int | None  # device bytes the policy planned against
    headroom: float  # share of the budget the policy plans to

    @property
    def working_bytes(self) -> int:
        """What the policy charges for the layer-or-loss phase (they never run at once)."""
        return self.peak_bytes - self.resident_weight_bytes - self.boundary_bytes


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
    fill_drain_s: float  # megatrain: per step, the wait for the last gradients after backward (the first
    #                      load is inside forward_s); zero3: per micro-batch, first fetch + last gradient
    embed_io_s: float  # per step: embedding/head upload and gradient download (none on a CPU device in FP32)
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
    long_context: LongContext | None = None  # megatrain only

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
                       "pinned": self.memory.pinned, "unified": self.memory.unified},
            "time": dataclasses.asdict(self.time),
            "fits": self.fits,
            "reasons": list(self.reasons),
            "decisions": dict(self.decisions),
            "warnings": list(self.warnings),
            "long_context": dataclasses.asdict(self.long_context) if self.long_context else None,
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
            "mlp_tile_tokens": self.decisions.get("mlp_tile_tokens"),
            "master": p.master if p.backend == "megatrain" else None,
            "host_grad_dtype": p.host_grad_dtype if p.backend == "megatrain" else None,
            "optimizer_in_backward": p.optimizer_in_backward if p.backend == "megatrain" else None,
            "step_time_s": t.step_s,
            "tokens_per_s": self.tokens_per_s,
            "flops_per_step": self.model_flops,
            "model_tflops": self.model_tflops,
            "device_peak_tflops": hw.peak_flops(p.dtype) / 1e12,
            "peak_source": "measured" if measured_peak else "table",
            "mfu": self.mfu,
            "forward_s": t.forward_s * g,
            "backward_s": (t.backward_s + t.head_s) * g,
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
            **self._long_context_columns(),
        }

    def _long_context_columns(self) -> dict[str, Any]:
        lc = self.long_context
        if lc is None:
            return {}
        return {"loss_chunk_tokens": lc.loss_chunk,
                "layer_working_bytes": lc.layer_working_bytes, "loss_workspace_bytes": lc.loss_workspace_bytes,
                "boundary_device_bytes": lc.boundary_bytes, "kept_boundaries": lc.kept_boundaries,
                "offloaded_activation_bytes": self.memory.host.get("offloaded activations", 0),
                "policy_peak_device_bytes": lc.peak_bytes}


# ------------------------------------------------------------------------------------ inputs


def make_point(model: Any, context: int, batch: int = 1, grad_accum: int = 1, dtype: str = "bfloat16",
               backend: str = "megatrain", engine_config: Any = None, **knobs: Any) -> Point:
    """Validate inputs into a Point. `engine_config` (an EngineConfig or anything with its attribute
    names) supplies num_buffers, loss_chunk_tokens, offload_activations, mlp_tile_tokens,
    device_budget_bytes, optimizer_overlap and compute_dtype."""
    m = resolve_model(model)
    if engine_config is not None:
        dtype = getattr(engine_config, "compute_dtype", dtype)
        for k in ("num_buffers", "loss_chunk_tokens", "offload_activations", "mlp_tile_tokens",
                  "device_budget_bytes", "optimizer_overlap"):
            if hasattr(engine_config, k):
                knobs.setdefault(k, getattr(engine_config, k))
    if "tile_tokens" in knobs:  # the planner's name before it took the engine's
        warnings.warn("tile_tokens is deprecated: use mlp_tile_tokens (EngineConfig's name)", DeprecationWarning,
                      stacklevel=3)
        knobs.setdefault("mlp_tile_tokens", knobs.pop("tile_tokens"))
    if "host_master" in knobs:  # EngineConfig's name for the same knob
        knobs["master"] = knobs.pop("host_master")
    unknown = set(knobs) - {f.name for f in dataclasses.fields(Point)}
    if unknown:
        raise ValueError(f"unknown planner setting(s) {sorted(unknown)}")
    for name, v in (("context", context), ("batch", batch), ("grad_accum", grad_accum),
                    ("num_buffers", knobs.get("num_buffers", 2)),
                    ("loss_chunk_tokens", knobs.get("loss_chunk_tokens", 1))):
        if v == "auto" and name == "loss_chunk_tokens":
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be an int >= 1" + (" or 'auto'" if name == "loss_chunk_tokens" else ""))
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {BACKENDS}")
    _is_bf16(dtype)  # raises on an unknown dtype
    _is_bf16(knobs.get("host_grad_dtype", "float32"))
    if knobs.get("master", "fp32") not in MASTERS:
        raise ValueError(f"master={knobs['master']!r}: use one of {MASTERS}")
    off = knobs.get("offload_activations", "auto")
    if off not in (True, False, "auto"):
        raise ValueError(f"offload_activations={off!r}: use True, False or 'auto'")
    tile = knobs.get("mlp_tile_tokens", "auto")
    if not (tile is None or tile == "auto" or (isinstance(tile, int) and not isinstance(tile, bool) and tile >= 1)):
        raise ValueError(f"mlp_tile_tokens={tile!r}: use None (untiled), 'auto' or an int >= 1")
    if knobs.get("zero_stage", 3) not in (2, 3):
        raise ValueError(f"zero_stage={knobs['zero_stage']!r}: the planner models ZeRO-2 and ZeRO-3 offload (2 or 3)")
    for k in ("zero3_prefetch_bucket", "zero3_persistence_threshold", "zero3_reduce_bucket"):
        v = knobs.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ValueError(f"{k}={v!r} must be an int >= 0 (elements) or None (the documented tuning)")
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


def _pin_model():
    """The engine's pinning rule (costs/pinning.py, torch-free)."""
    return pinning


def _tiling():
    """The engine's own long-context memory model (costs/memory.py, torch-free)."""
    return memory_model


def layer_dims(m: ModelPreset, expanded_kv: bool = False) -> Any:
    """The engine's LayerDims for a preset's (largest, i.e. every) decoder layer, as engine/tiling.py's layer_dims reads
    it from a built layer. Fields the engine's version lacks are left out, so the planner runs against
    the engine as it is."""
    tl = _tiling()
    known = {f.name for f in dataclasses.fields(tl.LayerDims)}
    # every planner family (llama, qwen2, mistral) is one of the engine's tileable layer classes, on sdpa
    optional = {"head_dim": m.head_dim, "attention_tiled": True}
    if expanded_kv:  # FP32 on CUDA: grouped key/value heads are expanded for the fused kernels (attention.py)
        optional["kv_expanded"] = (m.heads - m.kv_heads) * m.head_dim
    return tl.LayerDims(hidden=m.hidden, kv=m.kv_heads * m.head_dim, intermediate=m.intermediate,
                        numel=m.layer_params(), **{k: v for k, v in optional.items() if k in known})


def layer_working_set_bytes(m: ModelPreset, tokens: int, c: int, tile: int | None = None,
                            engine: bool = True) -> int:
    """Peak bytes one decoder layer's recompute + backward adds beyond its input and weights.
    engine=True: megatrain's path as engine/memory_model.py predicts it (MLP side over `tile` tokens at a
    time when tiled, the layer's weight gradients included); engine=False: an HF layer under gradient
    checkpointing (weight gradients excluded: the baselines count them with their parameters)."""
    if engine:
        return int(_tiling().layer_working_bytes(layer_dims(m), tokens, tile, c))
    kv = m.kv_heads * m.head_dim
    fp32_extra = WS_H_FP32_BF16 * m.hidden * 4 if c == 2 else 0.0
    return int(tokens * ((HF_WS_H * m.hidden + HF_WS_KV * kv + HF_WS_I * m.intermediate) * c + fp32_extra))


def chunked_loss_bytes(m: ModelPreset, tokens: int, c: int, chunk: int) -> int:
    """Peak bytes of megatrain's head + chunked loss, forward and backward (engine/memory_model.py)."""
    return int(_tiling().loss_workspace_bytes(tokens, m.hidden, m.vocab, chunk, c))


def layer_saved_bytes(m: ModelPreset, tokens: int, c: int) -> int:
    """Bytes one HF layer's forward saves for backward when nothing is recomputed."""
    kv = m.kv_heads * m.head_dim
    fp32_extra = WS_H_FP32_BF16 * m.hidden * 4 if c == 2 else 0.0
    return int(tokens * ((SAVED_H * m.hidden + SAVED_KV * kv + SAVED_I * m.intermediate) * c + fp32_extra))


def _master_bytes(p: Point) -> tuple[int, int]:
    """(host master bytes/param, bf16 shadow bytes/param) of the streamed layers (modes.py)."""
    master = HostMaster(p.master)
    return MASTER_BYTES[master], (SHADOW_BYTES if master is HostMaster.FP32 and p.c == 2 else 0)


def _layer_grad_bytes(p: Point) -> int:
    """Host gradient slab bytes/param of the streamed layers: none with the optimizer in backward."""
    return 0 if p.optimizer_in_backward else GRAD_BYTES[GradSlab(p.host_grad_dtype)]


def engine_refusal(p: Point) -> str | None:
    """Why EngineConfig / the engine would refuse this point's host-memory mode, or None."""
    master, bf16 = HostMaster(p.master), p.c == 2
    if master is not HostMaster.FP32 and not bf16:
        return f"host_master={p.master!r} needs bf16 compute"
    if GradSlab(p.host_grad_dtype) is GradSlab.BFLOAT16 and not p.optimizer_in_backward:
        if not bf16:
            return "bf16 gradient slabs need bf16 compute"
        if p.grad_accum > 1:
            return "bf16 gradient slabs refuse gradient accumulation"
    if p.optimizer_in_backward:
        if p.grad_accum > 1:
            return "optimizer_in_backward refuses gradient accumulation"
        if p.grad_clip:
            return "optimizer_in_backward refuses gradient clipping"
        if p.optimizer_overlap:
            return "optimizer_in_backward and optimizer_overlap are exclusive"
    return None


def _aliases_globals(p: Point, hw: Hardware) -> bool:
    """Whether the engine's device embedding/head/norm are the host masters themselves: on a CPU
    device computing in FP32 it aliases them (Engine._alias_globals), so they are never copied."""
    return hw.unified_memory and p.c == 4


def _device_budget(p: Point, hw: Hardware) -> int | None:
    """The device budget the engine's "auto" plans against: the configured one, else the GPU's memory;
    a CPU device has no limit unless configured."""
    if p.device_budget_bytes is not None:
        return p.device_budget_bytes
    return None if hw.unified_memory else hw.device_bytes


def long_context_plan(p: Point, hw: Hardware) -> LongContext:
    """Run the engine's LongContextPolicy on this point's shapes: the offload/tile choice the engine
    will make for the batch, and its predicted device peak, term by term."""
    tl = _tiling()
    m, c, T = p.model, p.c, p.tokens
    dims = layer_dims(m, expanded_kv=not hw.unified_memory and c == 4)
    resident = (p.num_buffers * m.layer_params() + m.embed_params() + m.hidden) * c  # buffers + globals
    policy = tl.LongContextPolicy(
        dims=dims, n_layers=m.num_layers, itemsize=c, vocab=m.vocab, loss_chunk=p.loss_chunk_tokens,
        tile_setting=p.mlp_tile_tokens, offload_setting=p.offload_activations, budget=_device_budget(p, hw),
        fixed_bytes=resident, **({} if hw.unified_memory else {"logits_cap": None}))  # GPU: sized from the budget
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "does not fit" is the planner's verdict to give, not a warning
        bp = policy.plan(T)
    kept = tl.OFFLOAD_IN_FLIGHT if bp.offload else m.num_layers
    chunk = getattr(bp, "loss_chunk", p.loss_chunk_tokens)  # an engine without "auto" chunks takes it as set
    return LongContext(
        offload=bp.offload, tile=bp.tile, kept_boundaries=kept, boundary_bytes=kept * T * m.hidden * c,
        layer_working_bytes=int(tl.layer_working_bytes(dims, T, bp.tile, c)),
        loss_workspace_bytes=int(tl.loss_workspace_bytes(T, m.hidden, m.vocab, chunk, c)), loss_chunk=chunk,
        resident_weight_bytes=resident, peak_bytes=int(bp.predicted_peak_bytes), budget=policy.budget,
        headroom=tl.BUDGET_HEADROOM)


def megatrain_memory(p: Point, hw: Hardware, lc: LongContext) -> Memory:
    """Host and device bytes per component of the engine at this point; the device side is the
    engine's own prediction (lc) plus the runtime's reserve."""
    m, c, T = p.model, p.c, p.tokens
    P, PL, L, h = m.param_count(), m.layer_params(), m.num_layers, m.hidden
    resident = m.embed_params() + h  # embedding, LM head, final norm
    alias = _aliases_globals(p, hw)
    mb, shadow = _master_bytes(p)
    gb = _layer_grad_bytes(p)
    G = P - L * PL  # embedding, head, final norm: FP32 master and gradient in every mode
    # What the engine pins on CUDA (the same rule as its store and preflight): each layer's streamed copy,
    # the resident masters, the staging slots, and the offloaded activations' host buffers.
    pin = {} if hw.unified_memory else _pin_model().pinned_bytes([PL] * L, resident, c, True, c)
    host = {
        "master weights": L * PL * mb + G * 4,
        "gradients": L * PL * gb + G * 4,
        "adam m": P * 4,
        "adam v": P * 4,
        "bf16 shadow (streams)": L * PL * shadow,  # only layers stream; resident params convert once
        # pinned slots of the largest layer that gradients land in on CUDA (schedule.py); a CPU device adds
        # gradients straight into the slabs, or stages them in two buffers with the optimizer in backward
        "pinned grad staging": pin.get("grad staging", 0) if pin else (2 * PL * c if p.optimizer_in_backward else 0),
        # one layer's FP32 master / gradient while the optimizer updates it (store.Scratch)
        "fp32 scratch (one layer)": PL * 4 * ((p.master != "fp32") + (gb != 4)),
        "offloaded activations": L * T * h * c if lc.offload else 0,
        # the head/norm gradient: on CUDA it lands in pinned staging of the resident parameters (global_grads.py),
        # on a CPU device in bf16 it arrives as an FP32 copy before it is added to its slab; a no-op when the
        # device globals are the masters
        "head gradient copy": 0 if alias else pin.get("resident grad staging", (m.vocab * h + h) * 4),
        # the embedding's row gradients on their way to the host (CUDA; kept from batch to batch): <= T rows
        "embedding row staging": 0 if not pin else T * (h * c + 8),
        "runtime": int(hw.host_reserved_gib * GIB),
    }
    device = {
        "layer buffers": p.num_buffers * PL * c,
        "embedding/head/norm": resident * c,
        "boundary activations": lc.boundary_bytes,  # all L resident, or a few in flight when offloaded
        # one layer's recompute + backward and the head/loss never run at once: the policy's larger
        "working set (layer or loss)": lc.working_bytes,
        "runtime": 0 if hw.unified_memory else int(hw.device_reserved_gib * GIB),
    }
    pinned = sum(pin.values()) + (host["offloaded activations"] + host["embedding row staging"] if pin else 0)
    return Memory(host, device, hw.unified_memory, shared=resident * c if alias else 0, pinned=pinned)


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


def zero3_sizes(p: Point) -> dict[str, int]:
    """prefetch bucket, persistence threshold, reduce bucket (elements) the run uses."""
    tuned = offload_tuning(p.model.hidden)
    return {"prefetch": p.zero3_prefetch_bucket if p.zero3_prefetch_bucket is not None
            else tuned["stage3_prefetch_bucket_size"],
            "persistence": p.zero3_persistence_threshold if p.zero3_persistence_threshold is not None
            else tuned["stage3_param_persistence_threshold"],
            "reduce": p.zero3_reduce_bucket if p.zero3_reduce_bucket is not None else tuned["reduce_bucket_size"]}


def zero3_memory(p: Point, hw: Hardware) -> Memory:
    """What DeepSpeed ZeRO-3 (or ZeRO-2) offload allocates. Host: the FP32 master partition, Adam m
    and v, the FP32 gradient partition the CPU optimizer reads, the compute-dtype gradient
    accumulation partition, and the compute-dtype parameter
    partition (ZeRO-3: the copy fetches read; ZeRO-2 keeps it on the device instead), plus the user's
    FP32 model, which is built whole before DeepSpeed partitions it (the peak of a run). Device: the
    modules fetched at once (current + prefetch bucket), the gradient bucket, activations."""
    m, c = p.model, p.c
    P, h = m.param_count(), m.hidden
    z = zero3_sizes(p)
    host = {"fp32 master weights": P * 4, "fp32 gradients": P * 4, "adam m": P * 4, "adam v": P * 4,
            # stage3.py grad_partitions_flat_buffer: gradients accumulate here in the model dtype
            # (grad_accum_dtype's default) before the FP32 copy the optimizer reads
            "gradient partitions (compute dtype)": P * c}
    if p.zero_stage == 3:
        host["params (compute dtype)"] = P * c
    host["user's fp32 model before partitioning"] = P * 4
    host["runtime"] = int(hw.host_reserved_gib * GIB)
    host["deepspeed runtime"] = ZERO3_RUNTIME_BYTES
    largest = max(m.hidden * m.intermediate, m.vocab * h)
    device: dict[str, int] = {}
    if p.zero_stage == 3:
        device["fetched params (module + prefetch)"] = int(min(ZERO3_MAX_LIVE_PARAMS, largest + z["prefetch"], P) * c)
    else:
        device["params (compute dtype)"] = P * c
    device.update({
        "grad reduce bucket": int(min(z["reduce"], P) * c),
        **_hf_activations(p),
        "runtime": 0 if hw.unified_memory else int(hw.device_reserved_gib * GIB),
    })
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


def layer_flops(p: Point) -> tuple[float, float, float]:
    """(GEMM FLOPs, attention FLOPs, elementwise bytes) of one decoder layer's forward, one micro-batch."""
    m, T = p.model, p.tokens
    lin = 2.0 * m.layer_params() * T
    attn = 2.0 * m.hidden * p.context * T  # causal QK^T + AV: 4 h s T x 1/2
    elem = T * (ELEM_H * m.hidden + ELEM_I * m.intermediate) * p.c
    return lin, attn, elem


def _layer_compute(p: Point, hw: Hardware) -> tuple[float, float, float]:
    """(forward, recompute, backward-only) seconds of one decoder layer for one micro-batch: FLOPs at
    the sustained rate, elementwise traffic at device memory bandwidth, and the profile's fixed cost
    per layer per phase (hw.layer_overhead_*_s: binding weights, dispatch, events, the pipeline's own
    work; measured through the engine on the CPU profile). The backward phase's fixed cost is charged
    once, on backward-only (the recompute runs in the same phase)."""
    R = hw.sustained_flops(p.dtype)
    lin, attn, elem_bytes = layer_flops(p)
    elem = elem_bytes / (hw.device_memory_bw_gbs * GB)
    fwd = (lin + attn) / R + elem
    bwd_only = (2 * lin + ATTN_BWD_RATIO * attn) / R + elem
    return fwd + hw.layer_overhead_fwd_s, fwd, bwd_only + hw.layer_overhead_bwd_s


def sustained_from_layer_time(p: Point, hw: Hardware, seconds: float) -> float:
    """The `sustained` fraction of peak at which this model's layer compute (forward + recompute +
    backward, as _layer_compute charges it, the profile's fixed per-layer costs included) takes
    `seconds`: a profile number from a measured layer (measure.layer_seconds), not from a measured step."""
    lin, attn, elem_bytes = layer_flops(p)
    elem = elem_bytes / (hw.device_memory_bw_gbs * GB)
    flops = 4 * lin + (2 + ATTN_BWD_RATIO) * attn
    fixed = 3 * elem + hw.layer_overhead_fwd_s + hw.layer_overhead_bwd_s
    return flops / (seconds - fixed) / hw.peak_flops(p.dtype)


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


@dataclass(frozen=True)
class _LayerCosts:
    """Seconds of each job the engine queues per streamed layer, and per micro-batch around them."""

    fwd: float  # forward compute
    bwd: float  # recompute + backward compute
    load: float  # weights host -> device (h2d stream)
    act: float  # one boundary activation over the link (each way), 0 when resident
    grad: float  # gradients device -> host (d2h stream)
    reduce: float  # adding them into the host slab
    cuda: bool  # CUDA: the add runs on a host thread after the copy, with pin_model.STAGING_SLOTS staging slots;
    #             a CPU device adds on the d2h worker, whose job lasts max(add, rate-limited copy)


class _PipelineSim:
    """Replays the issue order of engine/schedule.py (LayerPipeline) and activations.py on a compute
    timeline and the copy lanes, so fills, drains, the layers still resident at the forward/backward
    turn and across micro-batches, and every wait come out as the engine schedules them.

    Each lane runs its jobs in order; a job starts when it is issued (the compute timeline's clock)
    and its lane and inputs are free."""

    def __init__(self, n_layers: int, n_buffers: int, costs: _LayerCosts) -> None:
        self.L, self.c = n_layers, costs
        self.t = self.wait = 0.0
        self.lane = {"h2d": 0.0, "d2h": 0.0, "reduce": 0.0}
        self.bytes_jobs = {"load": 0, "act_out": 0, "act_in": 0, "grad": 0}  # job counts
        self.slots: list[int | None] = [None] * n_buffers
        self.loaded = [0.0] * n_buffers
        self.staging_free = [0.0] * _pin_model().STAGING_SLOTS
        self.next_staging = 0
        self.globals_free = 0.0  # the resident parameters' gradient staging (CUDA), free again
        self.written: dict[int, float] = {}  # offloaded activation -> when it reached the host
        self.act_ready: dict[int, float] = {}  # prefetched activation -> when it is back
        self.spans: list[tuple[str, str, int, float, float]] = []  # (lane, kind, layer, start, end), as Trace

    def _job(self, lane: str, ready: float, dur: float, kind: str, layer: int) -> float:
        start = max(ready, self.lane[lane])
        self.lane[lane] = start + dur
        self.spans.append((lane, kind, layer, start, start + dur))
        return self.lane[lane]

    def _compute(self, dur: float, kind: str, layer: int) -> None:
        self.spans.append(("compute", kind, layer, self.t, self.t + dur))
        self.t += dur

    def _wait_until(self, when: float) -> None:
        if when > self.t:
            self.wait += when - self.t
            self.t = when

    def _acquire(self, order: list[int], n: int) -> None:
        window = order[n: n + len(self.slots)]
        for layer in window:
            if layer not in self.slots:
                s = next(i for i, r in enumerate(self.slots) if r not in window)
                self.slots[s] = layer
                self.loaded[s] = self._job("h2d", self.t, self.c.load, "load", layer)
                self.bytes_jobs["load"] += 1
        self._wait_until(self.loaded[self.slots.index(order[n])])

    def _prefetch(self, layer: int) -> None:
        if self.c.act and layer not in self.act_ready:
            self.act_ready[layer] = self._job("h2d", max(self.t, self.written.pop(layer)), self.c.act, "act-in", layer)
            self.bytes_jobs["act_in"] += 1

    def _send_grad(self, layer: int) -> None:
        c = self.c
        self.bytes_jobs["grad"] += 1
        if not c.cuda:
            self._job("d2h", self.t, max(c.grad, c.reduce), "grad", layer)
            return
        i = self.next_staging
        self.next_staging = (i + 1) % len(self.staging_free)
        self.t = max(self.t, self.staging_free[i])  # the host blocks until that staging buffer is free
        copied = self._job("d2h", self.t, c.grad, "grad", layer)
        self.staging_free[i] = self._job("reduce", copied, c.reduce, "reduce", layer)

    def forward(self) -> None:
        order = list(range(self.L))
        for n, i in enumerate(order):
            self._acquire(order, n)
            if self.c.act:
                self.written[i] = self._job("d2h", self.t, self.c.act, "act-out", i)
                self.bytes_jobs["act_out"] += 1
            self._compute(self.c.fwd, "fwd", i)

    def backward(self) -> None:
        order = list(reversed(range(self.L)))
        for n, i in enumerate(order):
            self._acquire(order, n)
            if n + 1 < len(order):
                self._prefetch(order[n + 1])
            if self.c.act:
                self._prefetch(i)
                self._wait_until(self.act_ready.pop(i))
            self._compute(self.c.bwd, "bwd", i)
            self._send_grad(i)

    def drain(self) -> None:
        """What the engine's synchronize_grads / collect_stats wait for."""
        self.t = max(self.t, *self.lane.values())

    def invalidate(self) -> None:
        """The optimizer changed the masters: resident layer copies are stale."""
        self.slots = [None] * len(self.slots)


def _engine_accum_bytes(p: Point) -> int:
    """Host bytes per layer-parameter to add a device gradient into its slab: the engine always adds
    (read the gradient, read + write the slab), on either device type."""
    return p.c + 2 * (2 if _is_bf16(p.host_grad_dtype) else 4)


@dataclass(frozen=True)
class _GlobalsIO:
    """What the engine spends on embedding/head/norm and their gradients (engine.py), on the compute
    thread, outside the copy streams."""

    add_s: float  # per micro-batch: adding the head/norm and embedding-row gradients into the host slabs
    down_s: float  # per micro-batch: bringing those gradients to the host
    up_s: float  # per step: refreshing the device copies after the optimizer
    down_bytes: int  # link bytes per micro-batch
    up_bytes: int  # link bytes per step


def _globals_io(p: Point, hw: Hardware) -> _GlobalsIO:
    """Per device type, as engine.py does it:
      - a CPU device in FP32 aliases them to the host masters (Engine._alias_globals): nothing moves;
      - a CPU device in bf16 casts them (host memory traffic, no link);
      - CUDA uploads them (pinned masters) after each optimizer step and brings the head/norm gradient
        and the embedding lookup's T x h gradient down per micro-batch into pinned staging, on the copy
        stream, where a host thread adds them (global_grads.py): off the compute thread (_async_globals)."""
    m, c, T, h = p.model, p.c, p.tokens, p.model.hidden
    resident, grads = m.embed_params() + h, m.vocab * h + h + T * h
    Bh = hw.host_bw_bps
    add = grads * 3 * 4 / Bh  # read the gradient, read + write the FP32 slab
    if _aliases_globals(p, hw):
        return _GlobalsIO(add, 0.0, 0.0, 0, 0)
    if hw.unified_memory:
        return _GlobalsIO(add, grads * (c + 4) / Bh, resident * (4 + c) / Bh, 0, 0)
    # CUDA: the staging (compute dtype) read, the FP32 slab read and written
    return _GlobalsIO(grads * (c + 8) / Bh, grads * c / hw.link_bps, resident * c / hw.link_bps, grads * c, resident * c)


def _async_globals(io: _GlobalsIO, costs: _LayerCosts) -> tuple[float, float] | None:
    """(copy, add) seconds of the resident parameters' gradients on the copy and reduce lanes (CUDA), or None
    when they are added on the compute thread (a CPU device)."""
    return (io.down_s, io.add_s) if costs.cuda else None


def _layer_costs(p: Point, hw: Hardware, offload: bool) -> _LayerCosts:
    m, c = p.model, p.c
    fwd_c, rec_c, bwd_only = _layer_compute(p, hw)
    Bl = hw.link_bps
    return _LayerCosts(fwd=fwd_c, bwd=rec_c + bwd_only, load=m.layer_params() * c / Bl,
                       act=p.tokens * m.hidden * c / Bl if offload else 0.0, grad=m.layer_params() * c / Bl,
                       reduce=m.layer_params() * _engine_accum_bytes(p) / hw.host_bw_bps,
                       cuda=not hw.unified_memory)


def _simulate_step(p: Point, costs: _LayerCosts, head: float,
                   globals_grads: tuple[float, float] | None = None) -> tuple[_PipelineSim, float, float, float]:
    """One step's micro-batches through the pipeline, up to the optimizer; returns the simulation and
    the forward, backward (summed over micro-batches) and final-drain seconds. `globals_grads`: (copy, add)
    seconds of the resident parameters' gradients when they travel on the copy and reduce lanes (CUDA:
    engine/global_grads.py), queued after the head; else they are part of `head`, on the compute thread."""
    sim = _PipelineSim(p.model.num_layers, p.num_buffers, costs)
    fwd_s = bwd_s = 0.0
    for _ in range(p.grad_accum):
        t0 = sim.t
        sim.forward()
        t1 = sim.t
        sim._compute(head, "head", -1)  # head + loss forward/backward (+ global gradients, off CUDA)
        if globals_grads is not None:
            sim.t = max(sim.t, sim.globals_free)  # the host waits for the staging the last micro-batch used
            copied = sim._job("d2h", sim.t, globals_grads[0], "head-grad", -1)
            sim.globals_free = sim._job("reduce", copied, globals_grads[1], "reduce-head-grad", -1)
        t2 = sim.t
        sim.backward()
        fwd_s += t1 - t0
        bwd_s += sim.t - t2
    t3 = sim.t
    sim.drain()  # clipping and the optimizer wait for every gradient
    return sim, fwd_s, bwd_s, sim.t - t3


def predicted_timeline(p: Point, hw: Hardware) -> list[dict[str, Any]]:
    """The planner's per-layer timeline of one step up to the optimizer, in the engine's trace format
    (stream, kind, layer, start_s, end_s), to set against a measured trace (EngineConfig.trace)."""
    lc = long_context_plan(p, hw)
    io = _globals_io(p, hw)
    costs = _layer_costs(p, hw, lc.offload)
    off = _async_globals(io, costs)
    head = _head_compute(p, hw, True) + (0.0 if off else io.add_s + io.down_s) + hw.microbatch_overhead_s
    sim = _simulate_step(p, costs, head, off)[0]
    return [{"stream": lane, "kind": kind, "layer": layer, "start_s": a, "end_s": b}
            for lane, kind, layer, a, b in sim.spans]


def megatrain_time(p: Point, hw: Hardware, offload: bool, owned_layers: int | None = None) -> Time:
    """`owned_layers`: decoder layers whose optimizer update this process runs (all of them by default;
    a data-parallel rank of a node whose optimizer is sharded by layer runs its share, planner/multi.py)."""
    m, c, T, L, g = p.model, p.c, p.tokens, p.model.num_layers, p.grad_accum
    own = L if owned_layers is None else owned_layers
    PL, h = m.layer_params(), m.hidden
    costs = _layer_costs(p, hw, offload)
    io = _globals_io(p, hw)
    # the head, its loss, the global gradients' adds (on this thread off CUDA), and the engine's fixed work
    # per micro-batch outside the layers
    off = _async_globals(io, costs)
    head = _head_compute(p, hw, recompute_logits=True) + (0.0 if off else io.add_s) + hw.microbatch_overhead_s
    sim, fwd_s, bwd_s, drain = _simulate_step(p, costs, head + (0.0 if off else io.down_s), off)
    embed_io = (0.0 if off else g * io.down_s) + io.up_s  # what the compute thread spends on them
    mb, shadow = _master_bytes(p)
    gb = 2 if _is_bf16(p.host_grad_dtype) else 4
    per_param = _optimizer_bytes_per_param(mb, gb, shadow, p.grad_clip)
    opt_busy = (m.param_count() - (L - own) * PL) * per_param / hw.optimizer_bps
    if p.optimizer_in_backward:
        # Each layer's update queued on one host thread as its gradients land (backward order): step()
        # waits for the last one (layer 0, whose backward is last), then updates the globals.
        u = PL * per_param / hw.optimizer_bps
        opt_globals = (m.param_count() - L * PL) * per_param / hw.optimizer_bps
        opt_added = opt_globals + max(u, own * u - bwd_s + bwd_s / L)
    elif p.optimizer_overlap:
        # As EngineConfig(optimizer_overlap=True) runs it (engine/optim.py): the globals update in step(),
        # the layers on a host thread in forward order while the next forward runs, each layer's forward
        # waiting for its update. With u per layer update and f per layer forward, the first micro-batch's
        # forward ends at max(L u + f, u + L f) instead of L f.
        u = PL * per_param / hw.optimizer_bps
        f_mb = fwd_s / g
        opt_globals = (m.param_count() - L * PL) * per_param / hw.optimizer_bps
        opt_added = opt_globals + max(own * u - f_mb + f_mb / L, u)
    else:
        opt_added = opt_busy
    step = sim.t + opt_added + io.up_s
    jobs = sim.bytes_jobs
    act = T * h * c
    h2d_bytes = jobs["load"] * PL * c + jobs["act_in"] * act + io.up_bytes
    d2h_bytes = jobs["grad"] * PL * c + jobs["act_out"] * act + g * io.down_bytes
    Bl = hw.link_bps
    busy = {
        "compute": g * (L * (costs.fwd + costs.bwd) + head),
        "link h2d": h2d_bytes / Bl,
        "link d2h": d2h_bytes / Bl if costs.cuda else max(d2h_bytes / Bl, g * L * costs.reduce),
        "host optimizer": opt_busy,
    }
    k = p.num_buffers
    over = max if k >= 2 else (lambda *xs: sum(xs))
    grad_lane = costs.grad if costs.cuda else max(costs.grad, costs.reduce)
    layer = LayerTime(costs.fwd, costs.load, costs.act, over(costs.fwd, costs.load, costs.act), costs.bwd,
                      costs.load + costs.act, grad_lane, over(costs.bwd, costs.load + costs.act, grad_lane))
    return Time(layer, fwd_s / g, bwd_s / g, head, drain, embed_io, opt_added, opt_busy, step,
                sim.wait, busy, int(h2d_bytes), int(d2h_bytes), _bottleneck(busy, p.optimizer_overlap))


def cpu_adam_rate(hw: Hardware) -> float:
    """DeepSpeedCPUAdam parameters/s on this host: the profile's measured rate; a profile without one
    falls back to a DRAM stream of AdamW's bytes (an upper bound: DeepSpeed's kernel is slower)."""
    if hw.cpu_adam_params_per_s:
        return hw.cpu_adam_params_per_s
    return hw.host_bw_bps / _optimizer_bytes_per_param(4, 4, 0, False)


def _zero3_passes(p: Point, hw: Hardware) -> tuple[PassCost, PassCost, float]:
    """(forward pass, backward pass incl. recompute, gradient bytes device->host) for one micro-batch."""
    m, c, L = p.model, p.c, p.model.num_layers
    R = hw.sustained_flops(p.dtype)
    Bh = hw.host_bw_bps
    lin, attn, elem_b = layer_flops(p)
    elem = elem_b / (hw.device_memory_bw_gbs * GB)
    fwd = (lin + attn) / R + elem
    bwd = (2 * lin + ATTN_BWD_RATIO * attn) / R + elem
    mods = decoder_layer_submodules(m.hidden, m.kv_heads * m.head_dim, m.intermediate, m.family == "qwen2",
                                    (attn / R) / fwd)
    z = zero3_sizes(p)
    stage3 = p.zero_stage == 3

    def fetched(sub: Submodule) -> int:
        return sum(n for n in sub.params if n > z["persistence"]) if stage3 else 0

    emb = m.vocab * m.hidden
    head_c = _head_compute(p, hw, recompute_logits=False)
    head_params = () if m.tie_embeddings else (emb,)
    # forward: embedding, the layers, final norm, LM head (a tied head re-fetches the embedding)
    fsteps = [Step(fetched(Submodule("embed", (emb,), 0)), 0.0)]
    for _ in range(L):
        fsteps += [Step(fetched(s), s.compute_share * fwd) for s in mods]
    fsteps += [Step(0, 0.0), Step(fetched(Submodule("lm_head", head_params or (emb,), 0)), head_c / 3)]
    # backward: per parameter a gradient hook; every reduce_bucket elements a flush that also casts
    # the bucket to FP32 on the host (read compute dtype, write FP32)
    bucket, flushes = [0], [0.0]

    def grads(n_params: tuple[int, ...]) -> float:
        extra = len(n_params) * hw.zero3_param_grad_hook_s
        bucket[0] += sum(n_params)
        while bucket[0] >= z["reduce"]:
            bucket[0] -= z["reduce"]
            extra += hw.zero3_bucket_flush_s + z["reduce"] * ((c + 4) / Bh + hw.zero3_grad_elem_s)
            flushes[0] += 1
        return extra

    bsteps = [Step(fetched(Submodule("lm_head", head_params or (emb,), 0)), 2 * head_c / 3,
                   grads(head_params or (emb,)))]
    for _ in range(L):
        if p.gradient_checkpointing:  # HF recomputes the layer's forward inside its backward
            bsteps += [Step(fetched(s), s.compute_share * fwd) for s in mods]
        bsteps += [Step(fetched(s), s.compute_share * bwd, grads(s.params)) for s in reversed(mods)]
    bsteps.append(Step(fetched(Submodule("embed", (emb,), 0)), 0.0, grads((emb,) if head_params else ())))
    hook = hw.zero3_module_hook_s if stage3 else 0.0
    link = hw.link_bps * (1.0 if p.zero3_pin_memory else PAGEABLE_LINK_FRACTION)
    overlap = _zero3_overlaps(p, hw)
    fp = run_pass(fsteps, c, link, hook, z["prefetch"], overlap)
    bp = run_pass(bsteps, c, link, hook, z["prefetch"], overlap)
    return fp, bp, float(m.param_count() * c)


def _zero3_overlaps(p: Point, hw: Hardware) -> bool:
    """Whether fetches, hooks and compute can run side by side. With a CPU as the device there is no
    asynchronous device or copy engine: DeepSpeed's gathers, its hooks and the layers' compute all run
    on the calling thread, one after the other (measured: results/zero3_mechanisms)."""
    return p.zero3_overlap and not hw.unified_memory


def zero3_time(p: Point, hw: Hardware) -> Time:
    """DeepSpeed ZeRO-3 (zero_stage=3) or ZeRO-2 (zero_stage=2) offload, from its mechanisms
    (zero3_model.py): per-submodule fetches with DeepSpeed's lookahead and event limit, host hooks,
    gradient buckets with their FP32 cast, DeepSpeedCPUAdam at the host's measured rate after backward,
    and for ZeRO-2 the updated parameters' upload."""
    m, c, L = p.model, p.c, p.model.num_layers
    Bl = hw.link_bps * (1.0 if p.zero3_pin_memory else PAGEABLE_LINK_FRACTION)
    Bh = hw.host_bw_bps
    fp, bp, grad_bytes = _zero3_passes(p, hw)
    # gradients leave on their own lane (overlap_comm); the backward cannot end before they have
    d2h_s = grad_bytes / Bl
    backward = max(bp.seconds, d2h_s) if _zero3_overlaps(p, hw) else bp.seconds + d2h_s
    g = p.grad_accum
    P = m.param_count()
    opt = P / cpu_adam_rate(hw)
    if p.grad_clip:
        opt += P * 4 / Bh  # the global norm over the FP32 gradient partition
    upload = P * c / Bl if p.zero_stage == 2 else 0.0  # ZeRO-2: updated parameters back to the device
    step = g * (fp.seconds + backward) + opt + upload
    h2d_bytes = g * (fp.fetched_elements + bp.fetched_elements) * c + (P * c if p.zero_stage == 2 else 0)
    d2h_bytes = g * grad_bytes
    compute = fp.compute_s + bp.compute_s
    busy = {"compute": g * compute, "link h2d": h2d_bytes / Bl, "link d2h": d2h_bytes / Bl,
            "host optimizer": opt, "host hooks": g * (fp.host_s + bp.host_s)}
    wait = g * (fp.seconds + backward - compute)
    layer = LayerTime(fp.compute_s / L, fp.fetch_s / L, 0.0, fp.seconds / L, bp.compute_s / L, bp.fetch_s / L,
                      d2h_s / L, backward / L)
    return Time(layer, fp.seconds, backward, 0.0, 0.0, upload, opt, opt, step, wait, busy,
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
    if "host hooks" in busy:
        cands["host hooks"] = busy["host hooks"]
    if opt_overlapped:
        cands["optimizer"] = opt if opt > compute else 0.0
    return max(cands, key=lambda k: cands[k])


def link_crossover_tokens(p: Point, hw: Hardware) -> float:
    """Tokens per micro-batch at which a layer's forward compute equals its weight transfer
    (N = Phi / B for bf16 weights, 2 Phi / B for fp32, attention and elementwise included, and the
    profile's fixed cost per layer, which hides part of the transfer at any size): below it the link
    is the bottleneck, above it compute is."""
    fwd_c, _, _ = _layer_compute(p, hw)
    per_token = (fwd_c - hw.layer_overhead_fwd_s) / p.tokens  # linear in T at fixed context
    load = p.model.layer_params() * p.c / hw.link_bps
    return max(0.0, load - hw.layer_overhead_fwd_s) / per_token


def crossover_closed_form(hw: Hardware, dtype: str) -> float:
    """Phi / B for bf16 weights (2 Phi / B for fp32): GEMM-only forward, sustained rate, achieved link."""
    c = 2 if _is_bf16(dtype) else 4
    return c * hw.sustained_flops(dtype) / (2 * hw.link_bps)


# ------------------------------------------------------------------------------------ plan


def plan(model: Any, context: int, batch: int = 1, grad_accum: int = 1, dtype: str = "bfloat16",
         hardware: str | Hardware | dict = "h200-pcie", backend: str = "megatrain", *,
         engine_config: Any = None, link_gbs: float | None = None, host_memory_gib: float | None = None,
         device_memory_gib: float | None = None, **knobs: Any) -> Plan:
    """Predict memory per component, step time, throughput and fit for one training point.

    knobs: num_buffers, offload_activations (True/False/'auto'), mlp_tile_tokens (None/'auto'/int;
    tile_tokens is its deprecated alias), device_budget_bytes,
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
    notes = []
    if p.context > p.model.max_positions:
        notes.append(f"context {p.context} exceeds the model's max_position_embeddings "
                     f"{p.model.max_positions}: the engine refuses it unless RoPE is extended")
    if p.backend == "megatrain" and p.optimizer_overlap and hw.unified_memory:
        notes.append("on a CPU 'device' the overlapped optimizer competes with compute for the same cores")
    lc = None
    if p.backend == "megatrain":
        refused = engine_refusal(p)
        if refused:
            notes.append(f"the engine refuses this mode here: {refused}")
        # the offload/tile choice is the engine's own (tiling.LongContextPolicy), so the plan is what runs
        lc = long_context_plan(p, hw)
        if lc.budget is not None and lc.peak_bytes > lc.headroom * lc.budget:
            notes.append(f"the engine's predicted device peak {fmt_bytes(lc.peak_bytes)} exceeds "
                         f"{lc.headroom:.0%} of its budget {fmt_bytes(lc.budget)}; it will warn and may run out")
        mem = megatrain_memory(p, hw, lc)
        t = megatrain_time(p, hw, lc.offload)
        decisions: dict[str, Any] = {"offload_activations": lc.offload, "mlp_tile_tokens": lc.tile,
                                     "loss_chunk_tokens": lc.loss_chunk}
    elif p.backend == "zero3":
        mem, t = zero3_memory(p, hw), zero3_time(p, hw)
        decisions = {"gradient_checkpointing": p.gradient_checkpointing}
    else:
        mem, t = torch_memory(p, hw), torch_time(p, hw)
        decisions = {"gradient_checkpointing": p.gradient_checkpointing}
    ok, reasons = check_fit(mem, hw, host_avail, device_avail)
    return Plan(p, hw, mem, t, ok, reasons, decisions, notes, lc)


def with_point(p: Point, **changes: Any) -> Point:
    return dataclasses.replace(p, **changes)


def ceil_div(a: float, b: float) -> int:
    return int(math.ceil(a / b))
