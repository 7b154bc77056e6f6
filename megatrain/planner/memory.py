"""Memory per component at a point, by backend, and whether it fits: megatrain's host store by mode and
its device side as the engine's own model predicts it (costs/memory.py, run on the preset's shapes);
DeepSpeed ZeRO-3 / ZeRO-2 offload as stage3.py allocates; plain PyTorch with everything on the device."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field

from megatrain.models.presets import ModelPreset

from ..costs import memory as device_model
from ..costs import residency as kept_model
from ..costs.modes import GRAD_BYTES, GradSlab
from ..costs.pinning import pinned_bytes
from .hardware import GIB, Hardware
from .point import Point, aliases_globals, layer_grad_bytes, master_bytes, rollback_bytes, speculative_layers
from .zero3_model import offload_tuning

# ---- Activation memory, elements per token, all linear in T (sdpa keeps attention O(T)).
# HF decoder layer under HF gradient checkpointing (the zero3/torch baselines): measured on
# transformers 5.x by tracking live tensor storages (TorchDispatchMode) through a recomputed forward +
# torch.autograd.grad of one Llama/Qwen2 layer, fitted over h, kv, intermediate and T:
# peak = 9.3 h + 2 kv + 6 I (weight grads excluded).
HF_WS_H, HF_WS_KV, HF_WS_I = 9.3, 2.0, 6.0
# With bf16 compute the RMSNorms upcast to fp32: ~1.5 h extra fp32 elements per token (measured as
# above, bf16 vs fp32), half on each side of the layer.
WS_H_FP32_BF16 = 1.5
# HF's ForCausalLMLoss over full logits: measured peak (forward + backward) = T x V x (c + 12)
# bytes: the logits in compute dtype (kept by the model output) + fp32 upcast, log-softmax, gradient.
LOSS_BYTES_EXTRA = 12
ZERO3_MAX_LIVE_PARAMS = 1e9  # stage3_max_live_parameters (DeepSpeed's default and the documented tuning)
# Host memory DeepSpeed's own runtime adds (its imports, JIT-built ops, the gloo process group):
# measured as the peak-RSS excess over the modelled states of the smallest quick-sweep point
# (zero3/tiny, 0.1M parameters, results/quick); the larger points are the held-out check.
ZERO3_RUNTIME_BYTES = 73 * 2**20


@dataclass
class Memory:
    host: dict[str, int]
    device: dict[str, int]
    unified: bool = False  # device allocations come out of host memory (CPU runs)
    shared: int = 0  # bytes listed in both pools because they are one allocation (aliased on a CPU device)
    pinned: int = 0  # the share of the host bytes that is page-locked (costs/pinning.py, page-exact)

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
    """The engine's own per-batch device plan for a megatrain point (costs/memory.py's
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
    # Residency (costs/residency.py): the layers kept on the device, and what a placement costs in device bytes
    residency: kept_model.Residency = field(default_factory=kept_model.Residency)
    n_layers: int = 0
    layer_bytes: int = 0  # one kept layer's weights in the compute dtype
    graph_bytes: int = 0  # one kept layer's forward graph for this batch
    ring_bytes: int = 0  # the streaming buffers, freed when every layer is kept
    graphs_allowed: bool = True  # False when the batch is tiled or offloads its boundary activations
    # device bytes the batch's working set leaves for residency (None: no limit, a CPU device)
    residency_room: int | None = None
    # one optimizer-resident layer's FP32 master, gradients and Adam state on the device (beyond its kept weights)
    optimizer_state_bytes: int = 0
    # the resident parameters' (embedding, head, norm) FP32 master, gradients and Adam state: on the device with any
    # optimizer-resident layer (engine/update/resident.py place_globals)
    globals_state_bytes: int = 0
    # host bytes left for offloaded graphs' saved activations (None: not checked; planner/placement.py sets it)
    graph_host_room: int | None = None
    # the side parameters' dense gradient beyond the boundaries and working set (the policy's side_grad_bytes term)
    side_gradient_bytes: int = 0

    def optimizer_bytes(self, optimizer: int) -> int:
        """Device bytes of `optimizer` optimizer-resident layers' state, the resident parameters' with them."""
        return optimizer * self.optimizer_state_bytes + (self.globals_state_bytes if optimizer else 0)

    @property
    def kept_optimizer_bytes(self) -> int:
        return self.optimizer_bytes(self.residency.optimizer)

    @property
    def kept_weight_bytes(self) -> int:
        return self.residency.weights * self.layer_bytes

    @property
    def kept_graph_bytes(self) -> int:
        """The graphs on the device at the forward/backward turn: the kept ones and the offloaded in flight."""
        return self.residency.device_graphs * self.graph_bytes

    @property
    def offloaded_graph_host_bytes(self) -> int:
        """The offloaded graphs' saved activations in host memory (pinned on CUDA: copied by DMA)."""
        return self.residency.offload * self.graph_bytes

    @property
    def ring_freed_bytes(self) -> int:
        return self.ring_bytes if self.n_layers and self.residency.weights >= self.n_layers else 0

    @property
    def residency_bytes(self) -> int:
        """What the placement adds to the device peak (the freed ring counted off)."""
        return self.kept_weight_bytes + self.kept_graph_bytes + self.kept_optimizer_bytes - self.ring_freed_bytes

    @property
    def working_bytes(self) -> int:
        """What the policy charges for the layer-or-loss phase (they never run at once)."""
        return (self.peak_bytes - self.resident_weight_bytes - self.boundary_bytes - self.residency_bytes
                - self.side_gradient_bytes)

    def fits(self, r: kept_model.Residency) -> bool:
        """Whether placement `r` fits the room the batch's working set leaves (graphs only where allowed)."""
        if r.weights > self.n_layers or (r.activations and not self.graphs_allowed):
            return False
        if self.graph_host_room is not None and r.offload * self.graph_bytes > self.graph_host_room:
            return False
        if self.residency_room is None:
            return True
        freed = self.ring_bytes if r.weights >= self.n_layers else 0
        return (r.weights * self.layer_bytes + r.device_graphs * self.graph_bytes
                + self.optimizer_bytes(r.optimizer) - freed <= self.residency_room)

    def placed(self, r: kept_model.Residency) -> LongContext:
        """This batch plan with placement `r` instead (its device peak follows)."""
        moved = dataclasses.replace(self, residency=r, peak_bytes=0)
        return dataclasses.replace(moved, peak_bytes=self.peak_bytes - self.residency_bytes + moved.residency_bytes)


def layer_dims(m: ModelPreset, expanded_kv: bool = False) -> device_model.LayerDims:
    """The engine's LayerDims for a preset's (largest, i.e. every) decoder layer, as engine/layer/tiling.py's
    layer_dims reads it from a built layer."""
    # every planner family (llama, qwen2, mistral) is one of the engine's tileable layer classes, on sdpa;
    # FP32 on CUDA expands grouped key/value heads for the fused kernels (engine/layer/attention.py)
    # a mixture of experts: activations as wide as the experts a token uses (top-k + shared), the weight
    # gradients of the largest layer with all its experts
    # hyper-connections: a boundary holds every residual stream (the engine reads them off the layer, tiling.py)
    return device_model.LayerDims(hidden=m.hidden, kv=m.kv_heads * m.head_dim, intermediate=m.mlp_width(),
                                  numel=m.largest_layer_params(), attention_tiled=True, head_dim=m.head_dim,
                                  kv_expanded=(m.heads - m.kv_heads) * m.head_dim if expanded_kv else 0,
                                  streams=m.residual_streams)


def layer_working_set_bytes(m: ModelPreset, tokens: int, c: int, tile: int | None = None,
                            engine: bool = True) -> int:
    """Peak bytes one decoder layer's recompute + backward adds beyond its input and weights.
    engine=True: megatrain's path as costs/memory.py predicts it (MLP side over `tile` tokens at a
    time when tiled, the layer's weight gradients included); engine=False: an HF layer under gradient
    checkpointing (weight gradients excluded: the baselines count them with their parameters)."""
    if engine:
        return int(device_model.layer_working_bytes(layer_dims(m), tokens, tile, c))
    kv = m.kv_heads * m.head_dim
    fp32_extra = WS_H_FP32_BF16 * m.hidden * 4 if c == 2 else 0.0
    return int(tokens * ((HF_WS_H * m.hidden + HF_WS_KV * kv + HF_WS_I * m.mlp_width()) * c + fp32_extra))


def layer_saved_bytes(m: ModelPreset, tokens: int, c: int) -> int:
    """Bytes one layer's forward saves for backward when nothing is recomputed: its input and the graph autograd
    keeps. One model with the engine's kept graphs (costs/memory.py layer_graph_bytes, measured with
    saved_tensors_hooks): plain PyTorch without checkpointing runs the same decoder layers the engine binds, so
    what their forward saves is the same tensors. (The planner's earlier HF figure, 8.3 h + 2 kv + 4 I, is this
    7 h + 2 kv + 4 I plus the input's h, within 0.3 h: the RoPE tables and the attention's log-sum-exp, which
    the engine's model counts on their own.)"""
    return int(device_model.layer_graph_bytes(layer_dims(m), tokens, c) + tokens * m.boundary_width * c)


def _device_budget(p: Point, hw: Hardware) -> int | None:
    """The device budget the engine's "auto" plans against: the configured one, else the GPU's memory;
    a CPU device has no limit unless configured."""
    if p.device_budget_bytes is not None:
        return p.device_budget_bytes
    return None if hw.unified_memory else hw.device_bytes


def long_context_plan(p: Point, hw: Hardware) -> LongContext:
    """Run the engine's LongContextPolicy on this point's shapes: the offload/tile choice the engine
    will make for the batch, and its predicted device peak, term by term."""
    m, c, T, L = p.model, p.c, p.tokens, p.model.num_layers
    dims = layer_dims(m, expanded_kv=not hw.unified_memory and c == 4)
    ring = p.num_buffers * m.largest_layer_params() * c
    resident = ring + m.global_params() * c  # buffers + globals
    budget = _device_budget(p, hw)
    state_bytes = optimizer_state_bytes_per_param(p)
    policy = device_model.LongContextPolicy(
        dims=dims, n_layers=L, itemsize=c, vocab=m.vocab, loss_chunk=p.loss_chunk_tokens,
        tile_setting=p.mlp_tile_tokens, offload_setting=p.offload_activations, budget=budget,
        fixed_bytes=resident, residency=p.residency, ring_bytes=ring, optimizer_bytes=state_bytes,
        side_grad_bytes=m.side_params * c,
        **({} if hw.unified_memory else {"logits_cap": None}))  # GPU: sized from the budget
    G = m.param_count() - L * m.layer_params()  # the resident parameters, whose state goes first
    k = optimizer_layers(p, hw, policy)
    policy.hold_optimizer(k, G if k else 0)  # the engine fixes it first, when it is built
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "does not fit" is the planner's verdict to give, not a warning
        bp = policy.plan(T)
    kept = min(bp.in_flight, L) if bp.offload else L
    chunk = bp.loss_chunk
    lc = LongContext(
        offload=bp.offload, tile=bp.tile, kept_boundaries=kept,
        boundary_bytes=kept * device_model.boundary_bytes(dims, T, c),
        layer_working_bytes=int(device_model.layer_working_bytes(dims, T, bp.tile, c)),
        loss_workspace_bytes=int(device_model.loss_workspace_bytes(T, m.hidden, m.vocab, chunk, c)), loss_chunk=chunk,
        resident_weight_bytes=resident, peak_bytes=int(bp.predicted_peak_bytes), budget=policy.budget,
        headroom=device_model.BUDGET_HEADROOM, residency=bp.residency, n_layers=L, layer_bytes=dims.numel * c,
        graph_bytes=device_model.layer_graph_bytes(dims, T, c), ring_bytes=ring,
        graphs_allowed=bp.tile is None and not bp.offload,
        optimizer_state_bytes=dims.numel * state_bytes, globals_state_bytes=G * state_bytes,
        side_gradient_bytes=bp.side_gradient_bytes)
    # Under a budget the policy counts the placement into its peak, "auto" or counts alike (costs/memory.py
    # LongContextPolicy._residency; the optimizer-resident layers' state among its fixed bytes); with none, not at
    # all. Here the peak always holds the placement, and the room it was chosen in is kept for the planner's search.
    in_policy = lc.residency_bytes if budget is not None else 0
    base = lc.peak_bytes - in_policy
    room = None if budget is None else max(0, int(device_model.BUDGET_HEADROOM * budget) - base)
    return dataclasses.replace(lc, peak_bytes=base + lc.residency_bytes, residency_room=room)


def optimizer_state_bytes_per_param(p: Point) -> int:
    """Device bytes per parameter of an optimizer-resident layer's state (costs/residency.py): with bf16 gradient
    slabs the device update adds an FP32 work buffer beside them."""
    return kept_model.optimizer_bytes_per_param(GRAD_BYTES[GradSlab(p.host_grad_dtype)])


def side_gradient_bytes(p: Point, lc: LongContext) -> int:
    """Device bytes the side parameters' dense gradient adds to the peak: it comes out in the compute dtype every
    micro-batch when backward sends the per-layer inputs' gradients through their producer (engine/layer/
    side_inputs.py), after the last layer's backward, when the boundary activations and the layer's working set are
    gone; what it needs beyond them."""
    return lc.side_gradient_bytes  # the engine's own policy's term (costs/memory.py side_gradient_bytes)


def optimizer_refused(p: Point) -> bool:
    """Whether the engine refuses optimizer residency at this point (engine/update/resident.py refusal)."""
    return bool(p.optimizer_in_backward or p.master == "bf16" or p.data_parallel)


def optimizer_layers(p: Point, hw: Hardware, policy: device_model.LongContextPolicy) -> int:
    """The layers whose optimizer state the engine keeps on the device at this point (engine/update/resident.py):
    the counts as set, or "auto" as the engine sizes it (the policy's optimizer_layers; on a CPU device with no
    budget every layer with an FP32 master, none with hi/lo); none where the engine refuses it."""
    if optimizer_refused(p):
        return 0
    if p.engine.residency_set is not None:
        return min(p.engine.residency_set.optimizer, p.model.num_layers)
    if policy.budget is None:
        return p.model.num_layers if p.master == "fp32" else 0
    # the engine leaves one sequence of the model's context window free (resident.reserve_tokens), whatever the
    # micro-batch; a longer sequence (refused, but its memory still told) its own
    return policy.optimizer_layers(max(p.model.max_positions, p.context),
                                   p.model.param_count() - p.model.num_layers * p.model.layer_params())


def megatrain_memory(p: Point, hw: Hardware, lc: LongContext) -> Memory:
    """Host and device bytes per component of the engine at this point; the device side is the
    engine's own prediction (lc) plus the runtime's reserve."""
    m, c, T = p.model, p.c, p.tokens
    P, PL, L, h = m.param_count(), m.layer_params(), m.num_layers, m.hidden
    # embedding, LM head, final norm and the side parameters (Gemma 4's per-layer input table): the engine's device
    # globals, staged through pinned memory on CUDA as they are (costs/pinning.py, the engine's preflight)
    on_device = m.global_params()
    alias = aliases_globals(p, hw)
    mb, shadow = master_bytes(p)
    gb = layer_grad_bytes(p)
    G = P - L * PL  # embedding, head, final norm: FP32 master and gradient in every mode
    K = lc.residency.optimizer  # layers whose master, gradients and Adam state are on the device instead
    GH = 0 if K else G  # ... and the resident parameters' with them (resident.py place_globals)
    # What the engine pins on CUDA (the same rule as its store and preflight): each layer's streamed copy,
    # the resident masters, the staging slots, and the offloaded activations' host buffers.
    pin = {} if hw.unified_memory else pinned_bytes(m.layer_sizes(), on_device, c, True, c)
    host = {
        "master weights": (L - K) * PL * mb + GH * 4,
        "gradients": (L - K) * PL * gb + GH * 4,
        "adam m": ((L - K) * PL + GH) * 4,
        "adam v": ((L - K) * PL + GH) * 4,
        "bf16 shadow (streams)": (L - K) * PL * shadow,  # only layers stream; resident params convert once
        # pinned slots of the largest layer that gradients land in on CUDA (engine/pipeline/schedule.py); a CPU device adds
        # gradients straight into the slabs, or stages them in two buffers with the optimizer in backward
        "pinned grad staging": pin.get("grad staging", 0) if pin else (2 * PL * c if p.optimizer_in_backward else 0),
        # one layer's FP32 master / gradient while the optimizer updates it (store.Scratch)
        "fp32 scratch (one layer)": PL * 4 * ((p.master != "fp32") + (gb != 4)),
        "offloaded activations": L * T * m.boundary_width * c if lc.offload else 0,
        # residency `offload`: those graphs' saved activations, from their forward to their backward (host buffers
        # kept from batch to batch, pinned like the offloaded activations')
        "offloaded graphs (residency)": lc.offloaded_graph_host_bytes,
        # the head/norm gradient: on CUDA it lands in pinned staging of the resident parameters (global_grads.py),
        # on a CPU device in bf16 it arrives as an FP32 copy before it is added to its slab; a no-op when the
        # device globals are the masters
        # (the engine's host preflight counts the staging before the optimizer's placement is known, and so does
        # this; unused with the resident parameters' optimizer on the device)
        "head gradient copy": 0 if alias else pin.get("resident grad staging", (m.vocab * h + h) * 4),
        # the resident masters rounded to the compute dtype for their upload after each step (CUDA, not FP32)
        # (counted as the engine's host preflight counts it, before the optimizer's placement is known: with the
        # resident parameters' optimizer on the device it is let go after the build, ResidentUpload.close)
        "resident upload staging": pin.get("resident upload staging", 0),
        # the embedding's row gradients on their way to the host (CUDA; kept from batch to batch): <= T rows
        "embedding row staging": 0 if not pin or not GH else T * (h * c + 8),
        "runtime": int(hw.host_reserved_gib * GIB),
        # a copy of each layer's master and Adam state, to undo an update started before the step's verdict
        # (the host-updated layers': an optimizer-resident layer is not speculated)
        "speculative rollback copy": rollback_bytes(p, speculative_layers(p, hw, K, lc.offload,
                                                                          lc.offloaded_graph_host_bytes), K),
    }
    device = {
        # the streaming ring, freed when every layer is kept (costs/residency.py)
        "layer buffers": max(0, p.num_buffers * PL * c - lc.ring_freed_bytes),
        "kept layers' weights (residency)": lc.kept_weight_bytes,
        "kept layers' forward graphs (residency)": lc.kept_graph_bytes,
        "optimizer-resident layers' FP32 master, gradients, Adam m and v": K * lc.optimizer_state_bytes,
        "resident parameters' FP32 master, gradients, Adam m and v": lc.kept_optimizer_bytes - K * lc.optimizer_state_bytes,
        "embedding/head/norm": on_device * c,
        # Gemma 3n/4's per-layer input table's (and any side parameter's) dense gradient, after the layers' backward
        "side parameters' gradient (dense)": side_gradient_bytes(p, lc),
        "boundary activations": lc.boundary_bytes,  # all L resident, or a few in flight when offloaded
        # one layer's recompute + backward and the head/loss never run at once: the policy's larger
        "working set (layer or loss)": lc.working_bytes,
        "runtime": 0 if hw.unified_memory else int(hw.device_reserved_gib * GIB),
    }
    pinned = sum(pin.values()) + (host["offloaded activations"] + host["embedding row staging"]
                                  + host["offloaded graphs (residency)"] if pin else 0)
    return Memory(host, device, hw.unified_memory, shared=on_device * c if alias else 0, pinned=pinned)


def _hf_activations(p: Point) -> dict[str, int]:
    """Activations of an HF model on the device: boundary checkpoints (or everything, without
    checkpointing), the logits the output keeps, and the larger of a layer's recompute+backward and
    the loss's fp32 transients (they are not live at once)."""
    m, c, T, L = p.model, p.c, p.tokens, p.model.num_layers
    logits = T * m.vocab * c
    loss = T * m.vocab * LOSS_BYTES_EXTRA
    if p.gradient_checkpointing:
        return {"boundary activations": L * T * m.boundary_width * c, "full logits": logits,
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
    # MoE: the experts are one module. The head counts only when tied: an untied head is released before HF's
    # loss runs its backward (the device peak), a tied one is the embedding too and stays gathered (measured:
    # results/long_context/small-7m-128mib, untied; smollm-135m, tied).
    largest = max(m.hidden * m.mlp_width(active=False), m.vocab * h if m.tie_embeddings else 0)
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
    """Plain PyTorch with everything on the device: FP32 weights, gradients and AdamW state, bf16 compute by
    autocast. Autocast's bf16 copy of a weight is saved for its backward: with checkpointing only the layer
    being recomputed holds them (two: its forward's and its recompute's); without, every layer and the head
    keep theirs to the backward (the whole model in bf16 but the embedding, which is not cast)."""
    m, c = p.model, p.c
    P = m.param_count()
    casts = (m.largest_layer_params() * 2 if p.gradient_checkpointing
             else m.num_layers * m.layer_params() + m.vocab * m.hidden)
    device = {
        "fp32 weights": P * 4,
        "fp32 gradients": P * 4,
        "adam m + v": P * 8,
        "bf16 weight casts (autocast)": casts * 2 if c == 2 else 0,
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
