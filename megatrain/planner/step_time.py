"""Seconds per component of a step at a point, by backend: the compute model (FLOPs at the sustained
rate, elementwise traffic at device bandwidth, the profile's fixed costs); megatrain's step as the
engine's pipeline replayed (pipeline_sim.py) with its optimizer modes and the resident parameters' I/O;
DeepSpeed ZeRO-3 / ZeRO-2 offload from its mechanisms (zero3_model.py); plain PyTorch; the link crossover."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..costs import residency as kept
from ..costs.modes import HostMaster, rollback_bytes_per_param
from .hardware import GB, Hardware, _is_bf16
from .host_rates import host_slowdown
from .host_work import SerialWork, globals_reduce_bps, reducer_bps, reducer_bytes_per_param, serial_work
from .memory import LOSS_BYTES_EXTRA, zero3_sizes
from .node_path import GRAD_WIRE_BYTES, NodeShare
from .node_path import reducer_bytes_per_param as node_reducer_bytes
from .pipeline_sim import REDUCE_LANES, LayerCosts, PipelineSim, graph_bytes, simulate_step
from .point import Point, aliases_globals, master_bytes, overlap_on, speculative_layers
from .zero3_model import PassCost, Step, Submodule, decoder_layer_submodules, run_pass

# Memory-bound traffic of a layer's forward (norms, RoPE, residual adds, SiLU*up), elements read
# + written per token: an estimate from the op list, small next to the GEMMs on a GPU.
ELEM_H, ELEM_I = 20.0, 5.0
# Flash/memory-efficient attention backward recomputes the scores: 5 GEMMs vs 2 forward.
ATTN_BWD_RATIO = 2.5
PAGEABLE_LINK_FRACTION = 0.5  # assumption: pageable copies reach about half the pinned rate


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
    # megatrain: seconds per step the device computes nothing, by cause (they sum to step_s - busy "compute"),
    # and the optimizer_overlap the engine runs here ("auto" resolved as it resolves it)
    idle_s: dict[str, float] = field(default_factory=dict)
    optimizer_overlap: bool = False
    # decoder layers whose backward runs their forward again, per step (the engine's recomputed_layers), and
    # megatrain's placement the step was replayed with (costs/residency.py; None for the other backends)
    recomputed_layers: int = 0
    residency: kept.Residency | None = None


def layer_flops(p: Point) -> tuple[float, float, float]:
    """(GEMM FLOPs, attention FLOPs, elementwise bytes) of one decoder layer's forward, one micro-batch.
    A mixture of experts computes with its active parameters (router + top-k experts), not all it stores."""
    m, T = p.model, p.tokens
    lin = 2.0 * m.active_layer_params() * T
    # causal QK^T + AV: 4 w s T x 1/2, w the query width (hidden in Llama shapes), s the context the layers
    # attend over (sliding windows and linear attention less)
    attn = 2.0 * m.attention_score_width() * m.attention_context(p.context) * T
    elem = T * (ELEM_H * m.hidden + ELEM_I * m.mlp_width()) * p.c
    return lin, attn, elem


def layer_compute(p: Point, hw: Hardware) -> tuple[float, float, float]:
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
    backward, as layer_compute charges it, the profile's fixed per-layer costs included) takes
    `seconds`: a profile number from a measured layer (megatrain/metrics/bench.py, layer_seconds), not from a
    measured step."""
    lin, attn, elem_bytes = layer_flops(p)
    elem = elem_bytes / (hw.device_memory_bw_gbs * GB)
    flops = 4 * lin + (2 + ATTN_BWD_RATIO) * attn
    fixed = 3 * elem + hw.layer_overhead_fwd_s + hw.layer_overhead_bwd_s
    return flops / (seconds - fixed) / hw.peak_flops(p.dtype)


def head_compute(p: Point, hw: Hardware, recompute_logits: bool) -> float:
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


def device_optimizer_bytes_per_param(p: Point) -> int:
    """Device bytes per parameter of an optimizer-resident layer's step: the FP32 master, gradient and Adam state
    as plain PyTorch's step moves them (_optimizer_bytes_per_param), plus its bf16 shadow's write in bf16 compute
    (in FP32 the kept weights are the master itself)."""
    return _optimizer_bytes_per_param(4, 4, p.c if p.c == 2 else 0, p.grad_clip)


def device_optimizer_bps(hw: Hardware) -> float:
    """What the device's AdamW streams at: its memory bandwidth (a CPU device's: the host optimizer's rate)."""
    return hw.optimizer_bps if hw.unified_memory else hw.device_memory_bw_gbs * GB


def _engine_accum_bytes(p: Point) -> int:
    """Host bytes per layer-parameter to add a device gradient into its slab: the engine always adds
    (read the gradient, read + write the slab), on either device type."""
    return p.c + 2 * (2 if _is_bf16(p.host_grad_dtype) else 4)


@dataclass(frozen=True)
class GlobalsIO:
    """What the engine spends on embedding/head/norm and their gradients (engine.py), on the compute
    thread, outside the copy streams."""

    add_s: float  # per micro-batch: adding the head/norm and embedding-row gradients into the host slabs
    down_s: float  # per micro-batch: bringing those gradients to the host
    up_s: float  # per step: refreshing the device copies after the optimizer
    down_bytes: int  # link bytes per micro-batch
    up_bytes: int  # link bytes per step


def optimizer_rate_bps(p: Point, hw: Hardware, overlap: bool) -> float:
    """The host optimizer's bytes/s in the point's mode: the profile's FP32 rate at the mode's measured distance
    from FP32's (host_rates.host_slowdown), clamped to the host's bandwidth (host_work.py: rates measured on two
    threads, applied to every core)."""
    return min(hw.optimizer_bps / host_slowdown(p, overlap), max(hw.optimizer_bps, hw.host_bw_bps))


def globals_io(p: Point, hw: Hardware) -> GlobalsIO:
    """Per device type, as engine.py does it:
      - a CPU device in FP32 aliases them to the host masters (Placement.alias_globals): nothing moves;
      - a CPU device in bf16 casts them (host memory traffic, no link);
      - CUDA uploads them (pinned masters) after each optimizer step and brings the head/norm gradient
        and the embedding lookup's T x h gradient down per micro-batch into pinned staging, on the copy
        stream, where a host thread adds them (global_grads.py): off the compute thread (async_globals)."""
    m, c, T, h = p.model, p.c, p.tokens, p.model.hidden
    resident, grads = m.embed_params() + h, m.vocab * h + h + T * h
    Bh = hw.host_bw_bps
    add = grads * 3 * 4 / Bh  # read the gradient, read + write the FP32 slab
    if aliases_globals(p, hw):
        return GlobalsIO(add, 0.0, 0.0, 0, 0)
    if hw.unified_memory:
        return GlobalsIO(add, grads * (c + 4) / Bh, resident * (4 + c) / Bh, 0, 0)
    # CUDA: the staging (compute dtype) read, the FP32 slab read and written, on the globals' own worker beside
    # the layers' reducer: its share of the host's bandwidth, not all of it (host_work.py)
    return GlobalsIO(grads * (c + 8) / globals_reduce_bps(p, hw), grads * c / hw.link_bps, resident * c / hw.link_bps, grads * c, resident * c)


def device_globals_io(p: Point, hw: Hardware) -> GlobalsIO:
    """The resident parameters' optimizer on the device (engine/update/resident.py place_globals): their gradients
    added into the device slab on the compute thread (read c, read and write the FP32 slab, at the device's
    bandwidth), nothing copied down, and their compute copy refreshed there after the update (in the device
    optimizer's bytes: device_optimizer_bytes_per_param counts its write)."""
    m, c, T, h = p.model, p.c, p.tokens, p.model.hidden
    grads = m.vocab * h + h + T * h
    return GlobalsIO(grads * (c + 8) / device_optimizer_bps(hw), 0.0, 0.0, 0, 0)


def async_globals(io: GlobalsIO, costs: LayerCosts, on_device: bool = False) -> tuple[float, float] | None:
    """(copy, add) seconds of the resident parameters' gradients on the copy lane and their own reduce lane (CUDA),
    or None when they are added on the compute thread (a CPU device; their optimizer on the device)."""
    return (io.down_s, io.add_s) if costs.cuda and not on_device else None


def layer_costs(p: Point, hw: Hardware, offload: bool, own_reducer: bool = True,
                node: NodeShare | None = None) -> LayerCosts:
    """`own_reducer`: the reducer thread at its share of the host's cores (host_work.py); False: at the whole of
    `hw`'s host bandwidth (a data-parallel rank's view of the node, planner/multi.py). `node`: one GPU's share of
    the node path (planner/node_path.py): its shard over the link, the rest over NVLink, its shard's adds."""
    m, c = p.model, p.c
    fwd_c, rec_c, bwd_only = layer_compute(p, hw)
    Bl = hw.link_bps
    cuda = not hw.unified_memory
    PL = m.layer_params()
    if node is not None:
        return LayerCosts(fwd=fwd_c, bwd=rec_c + bwd_only, load=node.weights_s(PL, c, Bl),
                          act=p.tokens * m.boundary_width * c / Bl if offload else 0.0, grad=node.grads_s(PL, Bl),
                          reduce=PL / node.gpus * node_reducer_bytes(p) / reducer_bps(p, hw), cuda=cuda,
                          recompute=rec_c)
    # CUDA: the reducer thread at its share of the cores (host_work.py); a CPU device adds on the d2h worker
    reduce = (PL * reducer_bytes_per_param(p) / reducer_bps(p, hw) if cuda and own_reducer
              else PL * _engine_accum_bytes(p) / hw.host_bw_bps)
    return LayerCosts(fwd=fwd_c, bwd=rec_c + bwd_only, load=PL * c / Bl,
                       act=p.tokens * m.boundary_width * c / Bl if offload else 0.0, grad=PL * c / Bl,
                       reduce=reduce, cuda=cuda, recompute=rec_c)


def megatrain_time(p: Point, hw: Hardware, offload: bool, owned_layers: float | None = None,
                   own_reducer: bool = True, residency: kept.Residency | None = None,
                   node: NodeShare | None = None, speculated: int | None = None, owner_stride: int = 1) -> Time:
    """`owned_layers`: decoder layers whose optimizer update this process runs (all of them by default;
    a data-parallel rank of a node whose optimizer is sharded by layer runs its share, planner/multi.py; on the
    node path 1/G of every layer: L/G); `own_reducer`, `node`: as layer_costs; `residency`: the batch's placement
    (the memory plan's), as simulate_step. `speculated`: the first host-updated layers the speculative step takes,
    counted for the node (planner/multi.py node_speculation; None: as one process sizes them, speculative_layers);
    with several ranks each speculates its part of them: on the node path its 1/G ranges of each, on the per-rank
    path (`owner_stride` G: layer i is rank i % G's, this rank 0, the one with the most) the ones it owns."""
    m, c, T, L, g = p.model, p.c, p.tokens, p.model.num_layers, p.grad_accum
    own = L if owned_layers is None else owned_layers
    PL = m.layer_params()
    costs = layer_costs(p, hw, offload, own_reducer, node)
    # The resident parameters' optimizer goes on the device with any layer's (engine/update/resident.py
    # place_globals): no copy down, no host update on the launch thread, no rounding or upload.
    placed = residency if residency is not None else p.residency
    glob_dev = isinstance(placed, kept.Residency) and placed.optimizer > 0 and owned_layers is None
    io = device_globals_io(p, hw) if glob_dev else globals_io(p, hw)
    if node is not None:
        # the node path shards the resident parameters as it shards a layer (docs/DISTRIBUTED.md, section 2):
        # this rank moves, adds, updates and rounds 1/G of them
        io = GlobalsIO(io.add_s / node.gpus, io.down_s / node.gpus, io.up_s / node.gpus,
                       int(io.down_bytes / node.gpus), int(io.up_bytes / node.gpus))
    # the head, its loss, the global gradients' adds (on this thread off CUDA), and the engine's fixed work
    # per micro-batch outside the layers
    off = async_globals(io, costs, glob_dev)
    head = head_compute(p, hw, recompute_logits=True) + (0.0 if off else io.add_s) + hw.microbatch_overhead_s
    sim, fwd_s, bwd_s, drain = simulate_step(p, costs, head + (0.0 if off else io.down_s), off, residency)
    graphs = len(sim.residency.graphs)
    # Optimizer-resident layers (engine/update/resident.py) update on the device in step(), as plain PyTorch's
    # optimizer does (the same bytes per parameter at the device's bandwidth); the host updates the rest.
    K = min(sim.residency.optimizer, own)
    G = m.param_count() - L * PL  # embedding, head, final norm
    glob_dev = glob_dev and K > 0
    device_opt = (K * PL + (G if glob_dev else 0)) * device_optimizer_bytes_per_param(p) / device_optimizer_bps(hw)
    own -= K
    mb, shadow = master_bytes(p)
    gb = 2 if _is_bf16(p.host_grad_dtype) else 4
    per_param = _optimizer_bytes_per_param(mb, gb, shadow, p.grad_clip)
    overlap = overlap_on(p, hw)
    if speculated is None:  # the first host-updated layers, forward order
        speculated = speculative_layers(p, hw, K, offload, sim.residency.offload * graph_bytes(p))
    # this rank's share of the speculation's queue (speculative_wait): `part` of each of `lanes` layers, every
    # `stride`-th layer's landing and forward (one process: its own layers, whole, one after another)
    stride = max(1, owner_stride) if node is None else 1
    part = 1 / node.gpus if node is not None else 1.0
    lanes = own if node is None and stride == 1 else (L - K if node is not None else math.ceil((L - K) / stride))
    n_spec = min(lanes, math.ceil(speculated / stride))
    speculative = n_spec > 0
    spec_idle = 0.0  # of opt_added: the speculated updates' tail past backward (the rest: the layers not speculated)
    copy_s = 0.0  # the speculative step's rollback copies, on the optimizer's thread
    # the mode's own distance from its bytes bound (host_rates.py), never above the host's bandwidth: a mode measured
    # faster than FP32's whole step on two threads does not beat the bandwidth the pool's threads reach
    rate = optimizer_rate_bps(p, hw, overlap)
    own_globals = G / node.gpus if node is not None else G  # resident parameters this process updates
    opt_globals = 0.0 if glob_dev else own_globals * per_param / rate
    opt_busy = own * PL * per_param / rate + opt_globals
    if own == 0:
        opt_added = opt_globals  # every layer updates on the device (device_opt) or on another rank
    elif p.optimizer_in_backward:
        # Each layer's update queued on one host thread as its gradients land (backward order): step()
        # waits for the last one (layer 0, whose backward is last), then updates the globals.
        u = PL * per_param / rate
        opt_added = opt_globals + max(u, own * u - bwd_s + bwd_s / L)
    elif speculative:
        # As EngineConfig(speculative_step) runs it (engine/update/speculative.py): the first n_spec host-updated
        # layers' updates started in the last micro-batch's backward after a copy of their master and Adam state (read
        # and written once more: u_s per layer), the rest at step() (speculative_wait).
        # A step whose clip scales is restored and redone (not modelled: the clip is taken not to scale).
        rb = 2 * rollback_bytes_per_param(HostMaster(p.master), p.c == 2)
        u, u_s = part * PL * per_param / rate, part * PL * (per_param + rb) / rate
        Ls = L if stride == 1 else lanes
        added, spec_idle, done = speculative_wait(u, u_s, stride * bwd_s / g / L, stride * fwd_s / g / L, Ls, K,
                                                  n_spec, lanes, overlap)
        opt_added = opt_globals + added
        copy_s = done * part * PL * rb / rate
    elif overlap:
        # As EngineConfig(optimizer_overlap=True) runs it (engine/update/optim.py): the globals update in step(),
        # the layers on a host thread in forward order while the next forward runs, each layer's forward
        # waiting for its update. With u per layer update and f per layer forward, the first micro-batch's
        # forward ends at max(L u + f, u + L f) instead of L f.
        u = PL * per_param / rate
        f_mb = fwd_s / g
        opt_added = opt_globals + max(own * u - f_mb + f_mb / L, u)
    else:
        opt_added = opt_busy
    # the resident parameters' update runs on the launch thread once the layer jobs are queued, and their rounding
    # into the upload's staging after it on a worker of its own, which the next forward waits for (host_work.py)
    serial = SerialWork(0.0, 0.0) if glob_dev else serial_work(p, hw, int(own_globals), opt_globals)
    embed_io = (0.0 if off else g * io.down_s) + io.up_s  # what the compute thread spends on them
    opt_added += device_opt  # after the backward, on the compute stream (the device busy, not idle)
    step = sim.t + opt_added + serial.resident_round_s + io.up_s
    jobs = sim.bytes_jobs
    act = T * m.boundary_width * c  # every residual stream of a boundary
    graph = graph_bytes(p) if jobs["graph_out"] else 0  # an offloaded graph's saved activations, each way
    # on the node path this GPU's link carries its shards (and other domains'); NVLink the rest
    share = node.link_fraction if node is not None else 1.0
    grad_b = GRAD_WIRE_BYTES if node is not None else c
    h2d_bytes = jobs["load"] * PL * c * share + jobs["act_in"] * act + jobs["graph_in"] * graph + io.up_bytes
    d2h_bytes = jobs["grad"] * PL * grad_b * share + jobs["act_out"] * act + jobs["graph_out"] * graph + g * io.down_bytes
    Bl = hw.link_bps
    busy = {
        "compute": g * (L * (costs.fwd + costs.bwd) - graphs * costs.recompute + head) + device_opt,
        "link h2d": h2d_bytes / Bl,
        "link d2h": d2h_bytes / Bl if costs.cuda else max(d2h_bytes / Bl, g * (L - K) * costs.reduce),
        "host optimizer": opt_busy,
        "device optimizer": device_opt,
    }
    if node is not None:
        busy["NVLink"] = node.nvlink_s(PL, c, jobs["load"], jobs["grad"])
    if speculative:
        busy["host rollback copy"] = copy_s
    if costs.cuda:
        busy["host reducer"] = g * (L - K) * costs.reduce  # an optimizer-resident layer's adds are the device's
        busy["host serial (resident update + rounding)"] = serial.total_s
    every = speculative and n_spec == lanes  # no layer left to the step's queue but those the verdict overtook
    layers_cause = IDLE_LAYERS_SPECULATIVE if every else IDLE_LAYERS if overlap else IDLE_LAYERS_AFTER
    idle = _megatrain_idle(sim, drain, opt_added - device_opt, opt_globals, layers_cause,
                           serial.resident_round_s, io.up_s)
    if speculative and not every:  # the speculated layers' tail told apart from the layers not speculated
        moved = min(spec_idle, idle[layers_cause])
        idle[layers_cause] -= moved
        idle[IDLE_LAYERS_SPECULATIVE] = moved
    idle["other"] = max(0.0, step - busy["compute"] - sum(idle.values()))
    k = p.num_buffers
    over = max if k >= 2 else (lambda *xs: sum(xs))
    grad_lane = costs.grad if costs.cuda else max(costs.grad, costs.reduce)
    layer = LayerTime(costs.fwd, costs.load, costs.act, over(costs.fwd, costs.load, costs.act), costs.bwd,
                      costs.load + costs.act, grad_lane, over(costs.bwd, costs.load + costs.act, grad_lane))
    return Time(layer, fwd_s / g, bwd_s / g, head, drain, embed_io, opt_added, opt_busy, step,
                sim.wait, busy, int(h2d_bytes), int(d2h_bytes), _bottleneck(busy, overlap), idle, overlap,
                sim.recomputed, sim.residency)


def speculative_wait(u: float, u_s: float, b: float, f: float, L: int, K: int, n: int, own: int,
                     overlap: bool) -> tuple[float, float, float]:
    """(seconds the host-updated layers add to the step, of which the speculated layers' own tail past backward,
    layer updates the speculation ran: the step keeps them) of the speculative step (engine/update/speculative.py)
    with the first `n` of `own` host-updated layers (K..K+n-1, forward order; layers below K update on the device)
    speculated: u a layer's update, u_s one with its copy, b a layer's backward, f a layer's forward. The engine's
    queue replayed event by event:

    - layer j's gradient lands (L - j) b into the last backward, which ends at L b, when the step comes;
    - one host thread takes the speculations in landing order, each once its gradient has landed: it runs (u_s) unless
      the step came first, or the next layer down has landed already (the host is behind: put off); the lowest
      layer's, once run, takes the layers put off, lowest first, each while the step has not come;
    - the step queues every host-updated layer in forward order behind them: a speculation that ran costs nothing,
      any other layer u;
    - with overlap the next forward runs layer j once its update is done (below K: on the device, not waited for);
      without, step() returns when the queue is done.

    Why the first layers (the engine's choice): with overlap the next forward waits on layer j's update before layer
    j, and the step's queue starts with the lowest, so each layer speculated there takes a whole update u off the
    forward's wait; a last layer, which the forward reaches when the host is done with the rest anyway, saves only
    u - f. Where a speculation takes no longer than a layer's backward (u_s <= b), no n layers hide more (checked
    by search in tests/unit/test_planner_speculative_partial.py)."""
    end, t, kept, put_off = L * b, 0.0, set(), []
    for j in range(K + n - 1, K - 1, -1):
        start = max(t, (L - j) * b)
        if start >= end:
            continue  # the step came first
        if j > K and (L - j + 1) * b <= start:
            put_off.append(j)  # the next layer down has landed
            continue
        t = start + u_s
        kept.add(j)
        if j == K:
            for i in sorted(put_off):
                if t >= end:
                    break
                t += u_s
                kept.add(i)
    tail = max(0.0, t - end)
    queue, ready = tail, {}  # from the step on
    for j in range(K, K + own):
        queue += 0.0 if j in kept else u
        ready[j] = queue
    if not overlap:
        return queue, tail, len(kept)
    wait = 0.0  # the forward's, so far: layer j's forward would start at j f + wait
    for j in range(K, L):
        if ready.get(j, 0.0) > j * f + wait:
            wait = ready[j] - j * f
    return wait, max(0.0, tail - K * f), len(kept)


# The causes of the device's idle time per step (Time.idle_s), as `megatrain plan` names them.
IDLE_LINK = "compute waits on weight/activation copies"
IDLE_REDUCER = "backward waits on the gradient reducer (staging full)"
IDLE_DRAIN_REDUCE = "last gradients: the reducer's tail"
IDLE_DRAIN_LINK = "last gradients: the copies' tail"
IDLE_RESIDENT = "resident parameters' update (launch thread, after the layers' are queued)"
IDLE_LAYERS = "layer updates not hidden behind the next forward"
IDLE_LAYERS_AFTER = "layer updates after backward (not overlapped)"
IDLE_LAYERS_SPECULATIVE = "speculative layer updates not hidden behind backward"
IDLE_ROUND = "resident masters rounded to bf16 (its worker; the forward waits)"
IDLE_UPLOAD = "resident parameters' upload"
IDLE_COMM = "data-parallel gradient reduction not hidden"  # planner/multi.py


def _megatrain_idle(sim: PipelineSim, drain: float, opt_added: float, resident_update: float, layers: str,
                    round_s: float, upload: float) -> dict[str, float]:
    """Seconds per step the compute timeline waits, by cause; `resident_update` is the part of `opt_added` spent
    on the resident parameters, the rest (`layers`) the layers' updates the compute does not hide."""
    return {IDLE_LINK: sim.wait, IDLE_REDUCER: sim.staging_wait,
            IDLE_DRAIN_REDUCE if sim.drained_by in REDUCE_LANES else IDLE_DRAIN_LINK: drain,
            IDLE_RESIDENT: min(resident_update, opt_added), layers: max(0.0, opt_added - resident_update),
            IDLE_ROUND: round_s, IDLE_UPLOAD: upload}


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
    mods = decoder_layer_submodules(m.hidden, m.kv_heads * m.head_dim, m.mlp_width(active=False), m.family == "qwen2",
                                    (attn / R) / fwd)
    z = zero3_sizes(p)
    stage3 = p.zero_stage == 3

    def fetched(sub: Submodule) -> int:
        return sum(n for n in sub.params if n > z["persistence"]) if stage3 else 0

    emb = m.vocab * m.hidden
    head_c = head_compute(p, hw, recompute_logits=False)
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
                int(h2d_bytes), int(d2h_bytes), _bottleneck(busy, False),
                recomputed_layers=g * L if p.gradient_checkpointing else 0)


def torch_time(p: Point, hw: Hardware) -> Time:
    m, L = p.model, p.model.num_layers
    fwd_c, rec_c, bwd_only = layer_compute(p, hw)
    bwd_c = bwd_only + (rec_c if p.gradient_checkpointing else 0.0)
    head = head_compute(p, hw, recompute_logits=False)
    per_param = _optimizer_bytes_per_param(4, 4, 0, p.grad_clip)
    bw = hw.optimizer_bps if hw.unified_memory else hw.device_memory_bw_gbs * GB
    opt = m.param_count() * per_param / bw
    micro = L * (fwd_c + bwd_c) + head
    step = p.grad_accum * micro + opt
    busy = {"compute": p.grad_accum * micro, "link h2d": 0.0, "link d2h": 0.0, "device optimizer": opt}
    layer = LayerTime(fwd_c, 0.0, 0.0, fwd_c, bwd_c, 0.0, 0.0, bwd_c)
    return Time(layer, L * fwd_c, L * bwd_c, head, 0.0, 0.0, opt, opt, step, 0.0, busy, 0, 0,
                _bottleneck(busy, False), recomputed_layers=p.grad_accum * L if p.gradient_checkpointing else 0)


def _bottleneck(busy: dict[str, float], opt_overlapped: bool) -> str:
    compute = busy["compute"]
    link = max(busy["link h2d"], busy["link d2h"])
    opt = busy.get("host optimizer", busy.get("device optimizer", 0.0))
    cands = {"compute": compute, "link": link, "optimizer": opt}
    for k in ("host hooks", "NVLink"):
        if k in busy:
            cands[k] = busy[k]
    if opt_overlapped:
        cands["optimizer"] = opt if opt > compute else 0.0
    return max(cands, key=lambda k: cands[k])


def link_crossover_tokens(p: Point, hw: Hardware) -> float:
    """Tokens per micro-batch at which a layer's forward compute equals its weight transfer
    (N = Phi / B for bf16 weights, 2 Phi / B for fp32, attention and elementwise included, and the
    profile's fixed cost per layer, which hides part of the transfer at any size): below it the link
    is the bottleneck, above it compute is."""
    fwd_c, _, _ = layer_compute(p, hw)
    per_token = (fwd_c - hw.layer_overhead_fwd_s) / p.tokens  # linear in T at fixed context
    load = p.model.layer_params() * p.c / hw.link_bps
    return max(0.0, load - hw.layer_overhead_fwd_s) / per_token


def crossover_closed_form(hw: Hardware, dtype: str) -> float:
    """Phi / B for bf16 weights (2 Phi / B for fp32): GEMM-only forward, sustained rate, achieved link."""
    c = 2 if _is_bf16(dtype) else 4
    return c * hw.sustained_flops(dtype) / (2 * hw.link_bps)


@dataclass(frozen=True)
class LinkOverlap:
    """Whether a step's weight streaming hides behind its compute: every stored parameter of a layer crosses
    the link (a mixture-of-experts layer all its experts), the compute is only what the tokens use (top-k)."""

    streamed_bytes: int  # host -> device per step: each layer's weights, forward and backward
    compute_s: float  # compute per step at the sustained rate
    link_s: float  # the streamed bytes at the achieved link rate (the h2d lane's busy time)
    crossover_tokens: float  # tokens per micro-batch above which compute hides the link
    dense_crossover_tokens: float  # the same for a dense model that computes with all it streams

    @property
    def link_binds(self) -> bool:
        return self.link_s > self.compute_s


def link_overlap(p: Point, hw: Hardware, t: Time | None = None) -> LinkOverlap:
    """The overlap condition with total bytes over active compute: per step, L layers x 2 loads (forward,
    backward recompute) of layer_params() x c bytes against L x (forward + recompute + backward) compute;
    with `t` (megatrain_time at this point) the replayed step's own h2d bytes and busy times instead."""
    m, L, g = p.model, p.model.num_layers, p.grad_accum
    fwd, rec, bwd = layer_compute(p, hw)
    streamed = 2 * g * L * m.layer_params() * p.c
    compute = g * L * (fwd + rec + bwd)
    link = streamed / hw.link_bps
    if t is not None:
        streamed, compute, link = t.h2d_bytes, t.busy_s["compute"], t.busy_s["link h2d"]
    cross = link_crossover_tokens(p, hw)
    # a dense layer computing with every parameter it streams: forward GEMMs scale by total/active
    lin, attn, _ = layer_flops(p)
    dense_fwd = lin * m.layer_params() / max(1, m.active_layer_params()) + attn
    dense_cross = cross * (lin + attn) / dense_fwd if dense_fwd else cross
    return LinkOverlap(int(streamed), compute, link, cross, dense_cross)


@dataclass(frozen=True)
class ComputeTerms:
    """One micro-batch's compute in the planner's model, split as `megatrain bench` fits measured engine times
    against it (metrics/bench.py fit_layer_overhead: one rate for every FLOP, fixed costs per phase)."""

    layer_fwd_flops: float  # a decoder layer's forward: GEMMs + attention
    layer_bwd_flops: float  # its recompute + backward: 3 x the GEMMs, (1 + ATTN_BWD_RATIO) x the attention
    layer_elem_s: float  # a layer forward's elementwise traffic at the device's memory bandwidth
    head_flops: float  # the head and the chunked loss (logits recomputed in backward)
    head_fixed_s: float  # their non-FLOP seconds, with the resident parameters' gradient copy and add


def compute_terms(model: object, tokens: int, hw: Hardware, dtype: str = "float32") -> ComputeTerms:
    """`model` (a preset, a name, a config) at one sequence of `tokens` on profile `hw`, its fixed costs left out."""
    from .point import make_point

    zero = hw.with_(layer_overhead_fwd_s=0.0, layer_overhead_bwd_s=0.0, microbatch_overhead_s=0.0)
    inf = zero.with_(sustained_fp32=1e30, sustained_bf16=1e30)  # the head's non-FLOP terms alone
    p = make_point(model, tokens, 1, dtype=dtype)
    lin, attn, elem_bytes = layer_flops(p)
    io = globals_io(p, zero)
    head_fixed = head_compute(p, inf, recompute_logits=True) + io.add_s + io.down_s
    head_flops = (head_compute(p, zero, recompute_logits=True) - head_compute(p, inf, True)) * \
        zero.sustained_flops(dtype)
    return ComputeTerms(lin + attn, 3 * lin + (1 + ATTN_BWD_RATIO) * attn,
                        elem_bytes / (hw.device_memory_bw_gbs * 1e9), head_flops, head_fixed)
