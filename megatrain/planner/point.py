"""A training point to plan: the engine's settings as the user writes them (one EngineConfig, which checks them and
whose defaults are the engine's: host mode "auto", residency "auto", ...), the planner's own beside them (the shape of
the work, the backend, the baselines' knobs), and what the engine would refuse about its host-memory mode
(costs/modes.py)."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

from megatrain.models.presets import ModelPreset

from ..config.schema import AUTO, EngineConfig
from ..config.settle import LAYERED, EngineFacts, settle_engine
from ..costs import modes
from ..costs import residency as kept
from ..costs.modes import GRAD_BYTES, MASTER_BYTES, SHADOW_BYTES, GradSlab, HostMaster
from ..costs.pinning import pinned_bytes
from ..costs.rollback import layers_that_fit, rollback_budget
from .hardware import GIB, Hardware, _is_bf16
from .shapes import resolve_model

BACKENDS = ("megatrain", "zero3", "zero3-alst", "torch")


# The residency a point plans when it sets none: the engine's own default, so a plan is what the engine runs.
ENGINE_RESIDENCY = kept.parse(next(f.default for f in dataclasses.fields(EngineConfig) if f.name == "residency"))
# The engine's settings a point takes (EngineConfig's names; compute_dtype is the point's `dtype`): the ones that
# change a prediction. The rest of EngineConfig (trace, watchdog_s, ...) keeps its defaults.
ENGINE_KNOBS = ("num_buffers", "offload_activations", "mlp_tile_tokens", "loss_chunk_tokens", "device_budget_bytes",
                "host_master", "host_grad_dtype", "optimizer_in_backward", "optimizer_overlap", "speculative_step",
                "residency")
# The order a plan's JSON lists a point's settings in (Plan.to_dict)
_ORDER = ("model", "context", "batch", "grad_accum", "dtype", "backend", "num_buffers", "offload_activations",
          "mlp_tile_tokens", "loss_chunk_tokens", "device_budget_bytes", "host_master", "host_grad_dtype",
          "optimizer_in_backward", "optimizer_overlap", "speculative_step", "grad_clip", "gradient_checkpointing",
          "zero3_pin_memory", "zero3_overlap", "zero_stage", "zero3_prefetch_bucket", "zero3_persistence_threshold",
          "zero3_reduce_bucket", "residency", "data_parallel")


def _written(**settings: Any) -> EngineConfig:
    return EngineConfig(**settings)


@dataclass(frozen=True)
class Point:
    """One training configuration to plan: the engine's settings as the user writes them (`engine`, an EngineConfig
    with its defaults and "auto" as written; the planner settles "auto" as the engine does) and what the planner
    adds: the shape of the work, the backend, and the baselines' own knobs."""

    model: ModelPreset
    context: int
    batch: int = 1
    grad_accum: int = 1
    backend: str = "megatrain"
    engine: EngineConfig = dataclasses.field(default_factory=lambda: _written(compute_dtype="bfloat16"))
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
    # several data-parallel ranks (planner/multi.py): the engine keeps no layer's optimizer on the device then
    data_parallel: bool = False

    # The engine's settings, read from its config (never copied): what the models below read.
    @property
    def dtype(self) -> str:
        return self.engine.compute_dtype

    @property
    def num_buffers(self) -> int:
        return self.engine.num_buffers

    @property
    def offload_activations(self) -> bool | str:
        return self.engine.offload_activations

    @property
    def mlp_tile_tokens(self) -> int | str | None:
        return self.engine.mlp_tile_tokens

    @property
    def loss_chunk_tokens(self) -> int | str:
        return self.engine.loss_chunk_tokens

    @property
    def device_budget_bytes(self) -> int | None:
        return self.engine.device_budget_bytes

    @property
    def host_master(self) -> str:
        """fp32 (+ bf16 shadow in bf16 mode), hilo (exact split, no shadow), bf16 (paper's code); "auto" until a
        plan chooses it (auto_mode.py: the plan's point is the chosen mode's)."""
        return self.engine.host_master

    @property
    def host_grad_dtype(self) -> str:
        return self.engine.host_grad_dtype

    @property
    def optimizer_in_backward(self) -> bool:
        return self.engine.optimizer_in_backward

    @property
    def optimizer_overlap(self) -> bool | None:
        """None: "auto", as the engine settles it (overlap_on): on with a CUDA device."""
        return self.engine.optimizer_overlap

    @property
    def speculative_step(self) -> bool | str:
        """"auto" as the engine settles it (speculative_layers)."""
        return self.engine.speculative_step

    @property
    def residency(self) -> str | kept.Residency:
        """"auto" (the planner's placement within the device budget, placement.py) or counts (a Residency)."""
        return self.engine.residency

    @property
    def master(self) -> str:
        """host_master under the planner's old name (read-only; `make_point` and `with_point` take it too)."""
        return self.host_master

    @property
    def tokens(self) -> int:  # per micro-batch
        return self.batch * self.context

    @property
    def tokens_per_step(self) -> int:
        return self.tokens * self.grad_accum

    @property
    def c(self) -> int:  # bytes per element of the compute dtype
        return 2 if _is_bf16(self.dtype) else 4

    def as_dict(self) -> dict[str, Any]:
        """The point's settings as one flat mapping (a plan's JSON), the engine's among the planner's."""
        return {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
                for k, v in ((k, getattr(self, k)) for k in _ORDER)}


def make_point(model: Any, context: int, batch: int = 1, grad_accum: int = 1, dtype: str = "bfloat16",
               backend: str = "megatrain", engine_config: Any = None, **knobs: Any) -> Point:
    """Validate inputs into a Point: the engine's settings among `knobs` (ENGINE_KNOBS) written into its EngineConfig,
    which checks them; the planner's own checked here. `engine_config` (an EngineConfig or anything with its
    attribute names) supplies num_buffers, loss_chunk_tokens, offload_activations, mlp_tile_tokens,
    device_budget_bytes, optimizer_overlap, speculative_step, residency and compute_dtype."""
    m = resolve_model(model)
    if engine_config is not None:
        dtype = getattr(engine_config, "compute_dtype", dtype)
        for k in ("num_buffers", "loss_chunk_tokens", "offload_activations", "mlp_tile_tokens",
                  "device_budget_bytes", "optimizer_overlap", "speculative_step", "residency"):
            if hasattr(engine_config, k):
                knobs.setdefault(k, getattr(engine_config, k))
    if "tile_tokens" in knobs:  # the planner's name before it took the engine's
        warnings.warn("tile_tokens is deprecated: use mlp_tile_tokens (EngineConfig's name)", DeprecationWarning,
                      stacklevel=3)
        knobs.setdefault("mlp_tile_tokens", knobs.pop("tile_tokens"))
    _host_master_name(knobs)
    unknown = set(knobs) - set(ENGINE_KNOBS) - {f.name for f in dataclasses.fields(Point)} - {"engine"}
    if unknown:
        raise ValueError(f"unknown planner setting(s) {sorted(unknown)}")
    for name, v in (("context", context), ("batch", batch), ("grad_accum", grad_accum)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be an int >= 1")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {BACKENDS}")
    if knobs.get("zero_stage", 3) not in (2, 3):
        raise ValueError(f"zero_stage={knobs['zero_stage']!r}: the planner models ZeRO-2 and ZeRO-3 offload (2 or 3)")
    for k in ("zero3_prefetch_bucket", "zero3_persistence_threshold", "zero3_reduce_bucket"):
        v = knobs.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ValueError(f"{k}={v!r} must be an int >= 0 (elements) or None (the documented tuning)")
    dtype = "bfloat16" if _is_bf16(dtype) else "float32"  # raises on an unknown dtype
    engine = {k: knobs.pop(k) for k in ENGINE_KNOBS if k in knobs}
    return Point(model=m, context=context, batch=batch, grad_accum=grad_accum, backend=backend,
                 engine=_written(compute_dtype=dtype, **EngineConfig.spelled(engine)), **knobs)


def _host_master_name(knobs: dict[str, Any]) -> None:
    """The planner's old name for host_master, `master`, taken as EngineConfig's (both given: refused)."""
    if "master" in knobs:
        if "host_master" in knobs:
            raise ValueError("give host_master or its old name master, not both")
        knobs["host_master"] = knobs.pop("master")


def with_point(p: Point, **changes: Any) -> Point:
    """The point with `changes` (the engine's settings written into its config as written, which resolves afresh;
    `dtype` is its compute_dtype)."""
    _host_master_name(changes)
    engine = {k: changes.pop(k) for k in ENGINE_KNOBS if k in changes}
    if "dtype" in changes:
        engine["compute_dtype"] = changes.pop("dtype")
    if engine:
        changes["engine"] = p.engine.rewrite(**EngineConfig.spelled(engine))
    return dataclasses.replace(p, **changes)


def placeholder_mode(p: Point) -> Point:
    """A point of another backend, or one a model reads directly, with the FP32 master and slabs written where its
    host mode is "auto" (no plan of the engine chooses one there)."""
    if p.engine.host_mode_set:
        return p
    return with_point(p, host_master=HostMaster.FP32.value, host_grad_dtype=GradSlab.FLOAT32.value)


def engine_settings(p: Point) -> dict[str, Any]:
    """The point's engine settings under EngineConfig's names: the "megatrain" config section that runs what was
    planned (device_budget_bytes only when set; optimizer_overlap only when the point sets it: "auto" is the
    engine's own default, and writing what it resolves to on one machine would change it on another)."""
    d: dict[str, Any] = {"compute_dtype": p.dtype, "num_buffers": p.num_buffers,
                         "offload_activations": p.offload_activations, "mlp_tile_tokens": p.mlp_tile_tokens,
                         "loss_chunk_tokens": p.loss_chunk_tokens, "host_master": p.host_master,
                         "host_grad_dtype": p.host_grad_dtype, "optimizer_in_backward": p.optimizer_in_backward}
    if p.optimizer_overlap is not None:
        d["optimizer_overlap"] = p.optimizer_overlap
    if p.engine.speculation_set is not None:
        d["speculative_step"] = p.speculative_step
    if p.device_budget_bytes is not None:
        d["device_budget_bytes"] = p.device_budget_bytes
    if p.residency != ENGINE_RESIDENCY:  # only where it changes the engine's default
        d["residency"] = residency_setting(p.residency)
    return d


def residency_setting(r: str | kept.Residency) -> str | dict[str, int]:
    """A residency as the engine's config writes it: "auto", "stream" or {"weights": n, "activations": m}."""
    return kept.as_written(r)


def settled(p: Point, hw: Hardware) -> EngineConfig:
    """The engine's device- and optimizer-dependent "auto" at this point, settled as the engine settles it
    (megatrain/config/resolve.py settle_engine) with the profile's facts: a CUDA device unless the profile's memory is
    unified (a CPU "device"), and torch's AdamW (what the planner plans)."""
    cfg = EngineConfig(device="cpu", compute_dtype=p.dtype, optimizer_in_backward=p.optimizer_in_backward,
                       optimizer_overlap=None if p.optimizer_in_backward else p.optimizer_overlap,
                       speculative_step=AUTO if p.optimizer_in_backward else p.speculative_step)
    return settle_engine(cfg, EngineFacts("cpu" if hw.unified_memory else "cuda", LAYERED))[0]


def overlap_on(p: Point, hw: Hardware) -> bool:
    """Whether the engine overlaps the host update with the next forward at this point: as set, or for "auto"
    (None) as the engine settles it (`settled`)."""
    if p.optimizer_overlap is not None:
        return p.optimizer_overlap
    return p.backend == "megatrain" and settled(p, hw).optimizer_overlap


def rollback_bytes(p: Point, layers: int | None = None, first: int = 0) -> int:
    """Host bytes of the speculative step's rollback copies of `layers` decoder layers from layer `first` on, in
    forward order (None: every layer): each one's master and Adam state (costs/modes.py), by each layer's own size as
    the engine allocates them (a model whose layers differ: dense and sparse MLPs, ...)."""
    m = p.model
    per_param = modes.rollback_bytes_per_param(HostMaster(p.host_master), p.c == 2)
    if layers is None:
        return m.num_layers * m.layer_params() * per_param
    return sum(m.layer_sizes()[first:first + layers]) * per_param


def host_left_for_rollback(p: Point, hw: Hardware, optimizer_layers: int = 0, offload: bool = False,
                           graph_host_bytes: int = 0) -> int:
    """Host bytes the rollback copies may take at this point: costs/rollback.py rollback_budget, the one rule
    engine/update/speculative.py resolve sizes them with, fed what the engine measures there. Its free memory (resolve
    runs once the store is built, before the first batch) is the host's less what is held by then: the host-updated
    layers' master and shadow, the resident parameters' FP32 master unless they went to the device with
    `optimizer_layers` layers', the FP32 scratch of a split master or slab, what CUDA pins for the gradients' staging
    and the resident parameters' upload, and the runtime's reserve (planner/memory.py's rows of them). What is to
    come (state_to_come_bytes): the gradient slabs the first backward writes and the Adam state the first step
    creates. The first batch's host bytes: with `offload` the offloaded activations' host buffers, and the offloaded
    graphs' saved activations (`graph_host_bytes`, residency `offload`): allocated at the first batch, after resolve
    measured, before the first backward fills the copies (the engine's per-copy check sees them there)."""
    m, K = p.model, optimizer_layers
    L, PL = m.num_layers, m.layer_params()
    glob = 0 if K else m.param_count() - L * PL  # with any layer's optimizer on the device, theirs goes too
    grad = GradSlab(p.host_grad_dtype)
    per_layer = modes.layer_bytes_per_param(HostMaster(p.host_master), grad, False, p.c == 2)
    to_come = (L - K) * PL * (GRAD_BYTES[grad] + modes.ADAM_BYTES) + glob * (4 + modes.ADAM_BYTES)
    held = (L - K) * PL * per_layer + glob * 16 - to_come + int(hw.host_reserved_gib * GIB)
    held += PL * 4 * ((p.host_master != "fp32") + (GRAD_BYTES[grad] != 4))
    if not hw.unified_memory:
        pin = pinned_bytes(m.layer_sizes(), m.global_params(), p.c, True, p.c)
        held += sum(pin.get(k, 0) for k in ("grad staging", "resident grad staging", "resident upload staging"))
        held += p.tokens * (m.hidden * p.c + 8) if glob else 0  # the embedding's row gradients on their way down
    first_batch = (L * p.tokens * m.boundary_width * p.c if offload else 0) + graph_host_bytes
    return rollback_budget(hw.host_bytes - held, to_come, first_batch)


def speculative_layers(p: Point, hw: Hardware, optimizer_layers: int = 0, offload: bool = False,
                       graph_host_bytes: int = 0) -> int:
    """How many host-updated decoder layers the engine speculates at this point (`optimizer_layers` of the L update
    on the device instead, never speculated): as set (True: every one, False: none), or for "auto" as the engine
    settles it (`settled`: a CUDA device, not with the optimizer in backward), the first host-updated layers in
    forward order whose rollback copies fit the budget host_left_for_rollback gives (`offload`: the activations
    offloaded too), counted by costs/rollback.py layers_that_fit as engine/update/speculative.py resolve counts them.
    The engine takes the first host-updated layers in forward order (step_time.py says what that hides)."""
    host = p.model.num_layers - optimizer_layers
    if p.backend != "megatrain" or p.optimizer_in_backward or host <= 0:
        return 0
    if p.engine.speculation_set is not None:
        return host if p.engine.speculation_set else 0
    if settled(p, hw).speculative_step is False:
        return 0
    per_param = modes.rollback_bytes_per_param(HostMaster(p.host_master), p.c == 2)
    left = host_left_for_rollback(p, hw, optimizer_layers, offload, graph_host_bytes)
    return layers_that_fit(p.model.layer_sizes()[optimizer_layers:], per_param, left)


def speculative_on(p: Point, hw: Hardware) -> bool:
    """Whether the engine speculates every layer at this point, counted as if none updated on the device (the
    rollback copy of all of them, `rollback_bytes(p)`, fits where speculative_layers says so); a point where only
    some fit speculates speculative_layers of them."""
    return speculative_layers(p, hw) == p.model.num_layers > 0


def master_bytes(p: Point) -> tuple[int, int]:
    """(host master bytes/param, bf16 shadow bytes/param) of the streamed layers (costs/modes.py)."""
    master = HostMaster(p.host_master)
    return MASTER_BYTES[master], (SHADOW_BYTES if master is HostMaster.FP32 and p.c == 2 else 0)


def layer_grad_bytes(p: Point) -> int:
    """Host gradient slab bytes/param of the streamed layers: none with the optimizer in backward."""
    return 0 if p.optimizer_in_backward else GRAD_BYTES[GradSlab(p.host_grad_dtype)]


def engine_refusal(p: Point) -> str | None:
    """Why EngineConfig / the engine would refuse this point's host-memory mode, or None."""
    # (a mode that needs bf16 compute is refused by the point's EngineConfig when it is written)
    if GradSlab(p.host_grad_dtype) is GradSlab.BFLOAT16 and not p.optimizer_in_backward and p.grad_accum > 1:
        return "bf16 gradient slabs refuse gradient accumulation"
    if p.optimizer_in_backward:
        if p.grad_accum > 1:
            return "optimizer_in_backward refuses gradient accumulation"
        if p.grad_clip:
            return "optimizer_in_backward refuses gradient clipping"
        if p.optimizer_overlap:
            return "optimizer_in_backward and optimizer_overlap are exclusive"
    return None


def context_refusal(p: Point) -> str | None:
    """Why the engine would refuse this point's context, or None: it checks every batch against the positions
    the model's RoPE is defined for (engine/layer/batch.py), which ModelPreset.max_positions holds."""
    if p.backend != "megatrain" or p.context <= p.model.max_positions:
        return None
    return (f"context {p.context:,} exceeds the model's max_position_embeddings {p.model.max_positions:,}: "
            "shorten the context or extend RoPE (rope_scaling / rope_parameters, or a larger "
            "max_position_embeddings)")


def refusals(p: Point) -> list[str]:
    """Everything the engine would refuse about this point (its context, its host-memory mode), as
    "engine refuses ..., DOES NOT FIT" lines beside the memory pools' own."""
    why = [r for r in (context_refusal(p), engine_refusal(p) if p.backend == "megatrain" else None) if r]
    return [f"engine: refuses this point, DOES NOT FIT: {r}" for r in why]


def aliases_globals(p: Point, hw: Hardware) -> bool:
    """Whether the engine's device embedding/head/norm are the host masters themselves: on a CPU
    device computing in FP32 it aliases them (Placement.alias_globals), so they are never copied."""
    return hw.unified_memory and p.c == 4
