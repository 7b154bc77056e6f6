"""The engine's device-memory model for one batch: what one layer's tiled backward and the head/loss phase
hold, and the per-batch plan (sequence tile, loss chunk, activation offload) chosen from a device budget.

Plain arithmetic with no torch import, so the planner (`megatrain plan`) runs this same model without
loading the engine: the engine and the planner cannot disagree. The coefficients are measured with
`DeviceMemoryTracker` (see tests/unit/test_long_context.py) and are only as good as those tests.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

from . import residency as kept

log = logging.getLogger("megatrain")

MIN_TILE = 256  # below this the per-tile overhead (Python, kernel launches) outweighs the memory saved
# "auto" with no device budget tiles only once the untiled MLP working set is big enough to matter.
AUTO_MIN_MLP_BYTES = 256 * 2**20


# -- the per-batch plan ------------------------------------------------------------------------------

# Peak live elements per token of one layer's recompute + backward, measured with DeviceMemoryTracker
# (Llama shapes, FP32; tests/unit/test_long_context.py checks the prediction).
# Untiled, or tiled with the attention block kept whole (MLP-only tiling), the peak is the larger of:
#  - the attention backward: 11 h + 2 kv per token (the recomputed attention graph, its gradients);
#  - an MLP tile's backward: 9 h + 2 kv per token (the attention graph, kept meanwhile) plus, per token
#    of the tile, 2 h + 6 I (norm2 in/out; gate, up, their product and gradients).
# Untiled (tile = all tokens) that is 11 h + 2 kv + 6 I, from the MLP phase.
ATTN_PHASE_H, KV_PER_TOKEN, MLP_PHASE_H = 11.0, 2.0, 9.0
TILE_H, TILE_I = 2.0, 6.0
# Tiled attention (attn_tiling.py): per token of the sequence only K, V (compute dtype) and their FP32
# gradient accumulators dK, dV (the layer's input and the incoming gradient, overwritten by the input
# gradient, are the caller's); per token of a tile, the tile's attention graph (norm1, q, RoPE, attention
# output, o_proj, h) next to the MLP tile's 2 h + 6 I; and the FP32 weight-gradient accumulators plus the
# one tile's weight gradients in flight.
TILED_KV_BUFFERS = 2.0  # K and V, and dK and dV, each kv wide
# ... and around the layer, as the untiled phases above count them: the incoming gradient and the last
# layer's output (the head's input), h each, and the RoPE cos/sin tables, head_dim each.
TILED_AROUND_H, TILED_ROPE_HEAD_DIM = 2.0, 2.0
TILE_ATTN_H = 7.0
KV_EXPANDED_COPIES = 4  # expanded grouped heads (LayerDims.kv_expanded): K, V and their two gradients
WEIGHT_GRAD_EXTRA = 0.25  # a tile's own weight gradients, as a share of the layer's weights
# The floor tile with tiled attention: tile terms at this share of the sequence terms (smaller saves little).
TILED_FLOOR_SHARE = 0.125
FP32_NORM_H = 1.5  # bf16 compute: the RMSNorms' fp32 upcasts, in fp32 h-vectors per token (planner's figure)
BUDGET_HEADROOM = 0.9  # plan to this share of the budget: allocator fragmentation, estimate error
# "auto" optimizer residency is fixed when the engine is built, before any batch: it leaves the working set of a
# batch this long free (a longer one tiles or offloads in what is left, as it would with streamed layers).
OPTIMIZER_RESERVE_TOKENS = 4096
# Offloaded, the device holds about this many boundary activations at once, whatever the depth (measured):
# a layer's input and output, the next input prefetched, and one on its way out.
OFFLOAD_IN_FLIGHT = 4
# When that does not fit the budget, copies stop overlapping (engine/pipeline/activations.py): each input waits for its
# copy to the host, and in backward an input comes back only when its layer needs it: one fewer (measured,
# tests/unit/test_offload_in_flight.py).
OFFLOAD_IN_FLIGHT_TIGHT = 3
LOSS_LOGIT_COPIES = 3  # chunk logits (fp32), their softmax/gradient, and a transient
# A no-grad forward (an eval) saves no layer inputs: the device holds the layer's input and its output.
EVAL_BOUNDARIES = 2
# "auto" loss chunk: the largest chunk is DEFAULT_LOSS_CHUNK tokens, capped so one FP32 copy of the chunk's
# logits stays under AUTO_LOSS_LOGITS_BYTES (a 128k vocabulary at 2048 tokens would be 1 GiB a copy); with a
# device budget it is halved, down to MIN_LOSS_CHUNK, while the loss phase does not fit. Smaller chunks cost
# only more, smaller head GEMMs.
DEFAULT_LOSS_CHUNK, MIN_LOSS_CHUNK, AUTO_LOSS_LOGITS_BYTES = 2048, 128, 256 * 2**20
# On a GPU (logits_cap None) "auto" starts here instead and only the device budget shrinks it: the head's
# weight-gradient GEMM (vocab x chunk x hidden, accumulated into an FP32 vocab x hidden gradient) does
# ~chunk/4 FLOP per byte of that gradient, memory-bound below ~1k tokens on an H100/H200; the 256 MiB
# logits cap gave 256-token chunks for a 152k vocabulary.
MAX_DEVICE_LOSS_CHUNK = 4096
# The head + loss phase as a training forward runs it (engine/layer/loss.py tiled_norm_head_loss: final norm, head
# and loss per sequence tile, each tile's backward run in the forward). Per token of the sequence, in
# h-vectors: the last layer's output and its gradient. Per token of a tile (measured, FP32, with
# DeviceMemoryTracker, tests/unit/test_loss_in_forward.py): two FP32 copies of the logits (the logits, then the
# softmax and its scaled copy) and about four h-vectors (the norm's graph, the head's input, its gradient).
LOSS_SEQ_H, LOSS_TILE_H, LOSS_TILE_LOGIT_COPIES = 2.0, 4.0, 2
LOSS_BF16_FP32_H = 3.5  # bf16 compute: the final norm's fp32 upcast and fp32 gradients, in fp32 h-vectors per tile token
# The same phase as the norm followed by the chunked loss under autograd (the path for callers that ask for
# the logits or the hidden states): during the chunk loop and, at its peak, in the final norm's backward.
LOSS_LOOP_H, LOSS_NORM_H = 4.6, 6.5
# Logits handed back to a caller whose own loss runs on them (HF's ForCausalLMLoss, TRL's): the logits in the
# compute dtype and, per token x vocab, 12 FP32 bytes more at the loss's backward: the FP32 upcast (a copy in bf16;
# in FP32 the logits' own gradient instead), the log-softmax and its gradient. Measured with DeviceMemoryTracker
# (tests/unit/test_device_plan_items.py): 14 B per token x vocab on bf16 logits, 16 on FP32 ones.
CALLER_LOSS_FP32_BYTES = 12
# What a layer's forward graph keeps for backward (residency.py), beyond its input, per token: 7 h + 2 kv + 4 I
# tensors in the compute dtype, the RoPE tables (2 head_dim), the attention's FP32 log-sum-exp (one per head),
# and in bf16 the norms' FP32 upcasts (FP32_NORM_H). Measured on Llama layers with saved_tensors_hooks (FP32 and
# bf16, hidden 256-512, kv 128-256, intermediate 688-1376: within 1%); tests/unit/test_residency.py checks it.
GRAPH_H, GRAPH_KV, GRAPH_I, GRAPH_HEAD_DIM = 7.0, 2.0, 4.0, 2.0


@dataclass(frozen=True)
class LayerDims:
    hidden: int
    kv: int  # key/value width (kv_heads x head_dim)
    intermediate: int
    numel: int  # weights of the largest layer
    attention_tiled: bool = True  # whether a tiled layer also tiles its attention block (attn_tiling.py)
    head_dim: int = 128
    # Extra key/value width per token when grouped heads are expanded for SDPA (FP32 on CUDA, attention.py:
    # query width - kv): the expanded K and V, and their gradients, live through the attention's backward.
    kv_expanded: int = 0
    # Residual streams between layers (hyper-connections: DeepSeek-V4's hc_mult), each `hidden` wide: a layer
    # boundary's activation is streams x hidden per token (residual_streams reads it off a config).
    streams: int = 1


def residual_streams(config: object) -> int:
    """How many hidden-wide residual streams pass between layers: hyper-connections' expansion rate (`hc_mult`,
    DeepSeek-V4), else 1."""
    n = getattr(config, "hc_mult", None)
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1



def boundary_bytes(d: LayerDims, tokens: int, itemsize: int) -> int:
    """One layer boundary's activation: every residual stream (d.streams) of `tokens` tokens."""
    return tokens * d.hidden * d.streams * itemsize


def _tiled_seq_bytes(d: LayerDims, itemsize: int) -> float:
    """Per token of the sequence, with tiled attention: K, V in the compute dtype, dK, dV in FP32."""
    around = TILED_AROUND_H * d.hidden + TILED_ROPE_HEAD_DIM * d.head_dim
    return TILED_KV_BUFFERS * d.kv * (itemsize + 4) + around * itemsize


def _tiled_tile_bytes(d: LayerDims, itemsize: int) -> float:
    """Per token of a tile, with tiled attention."""
    b = ((TILE_ATTN_H + TILE_H) * d.hidden + TILE_I * d.intermediate) * itemsize
    return b + (FP32_NORM_H * d.hidden * 4 if itemsize < 4 else 0)


def layer_working_bytes(d: LayerDims, tokens: int, tile: int | None, itemsize: int) -> int:
    """Predicted peak bytes one layer's backward adds on the device, beyond its input and weights."""
    expanded = tokens * KV_EXPANDED_COPIES * d.kv_expanded * itemsize
    if tile is not None and tile < tokens and d.attention_tiled:
        return int(tokens * _tiled_seq_bytes(d, itemsize) + tile * _tiled_tile_bytes(d, itemsize)
                   + d.numel * (4 + WEIGHT_GRAD_EXTRA * itemsize) + expanded)
    t = tokens if tile is None else min(tile, tokens)
    kv = KV_PER_TOKEN * d.kv
    attn = tokens * (ATTN_PHASE_H * d.hidden + kv)
    mlp = tokens * (MLP_PHASE_H * d.hidden + kv) + t * (TILE_H * d.hidden + TILE_I * d.intermediate)
    upcasts = tokens * FP32_NORM_H * d.hidden * 4 if itemsize < 4 else 0
    attn += expanded // itemsize
    return int(max(attn, mlp) * itemsize + upcasts + d.numel * itemsize)  # + the layer's weight gradients


def layer_graph_bytes(d: LayerDims, tokens: int, itemsize: int) -> int:
    """Predicted bytes one layer's kept forward graph holds (residency.py), beyond its input and weights."""
    per = (GRAPH_H * d.hidden + GRAPH_KV * d.kv + GRAPH_I * d.intermediate + GRAPH_HEAD_DIM * d.head_dim) * itemsize
    per += 4 * max(1, d.hidden // max(d.head_dim, 1))  # the log-sum-exp, FP32, per head
    if itemsize < 4:
        per += FP32_NORM_H * d.hidden * 4
    return int(tokens * per)


def loss_workspace_bytes(tokens: int, hidden: int, vocab: int, chunk: int, itemsize: int) -> int:
    """Predicted peak bytes of the head + loss phase beyond the kept boundary activations, as a training
    forward runs it (in sequence tiles of `chunk` tokens, backward included): the last layer's output and
    its gradient per token, one tile's norm graph and logits, and the head's FP32 weight gradient (and its
    cast to the compute dtype)."""
    t = min(chunk, tokens)
    tile = LOSS_TILE_LOGIT_COPIES * vocab * 4 + LOSS_TILE_H * hidden * itemsize
    if itemsize < 4:
        tile += vocab * itemsize + LOSS_BF16_FP32_H * hidden * 4  # the logits before their upcast; the norm's
    cast = vocab * hidden * itemsize if itemsize < 4 else 0
    return int(LOSS_SEQ_H * tokens * hidden * itemsize + t * tile + vocab * hidden * 4 + cast)


def logits_workspace_bytes(tokens: int, vocab: int, itemsize: int) -> int:
    """The full logits handed back to the caller (no labels, or logits asked for): tokens x vocab in the compute
    dtype, and what the loss the caller computes from them holds at its backward (CALLER_LOSS_FP32_BYTES: an HF or
    TRL loss, label smoothing, distillation): 14 B per token x vocab on bf16 logits, 16 on FP32 ones."""
    return tokens * vocab * (itemsize + CALLER_LOSS_FP32_BYTES)


def side_gradient_bytes(side_bytes: int, boundaries: int, working: int) -> int:
    """What the side parameters' dense gradient (`side_bytes`: Gemma 3n/4's per-layer input table and projection,
    models/side.py, in the compute dtype) adds to a training batch's peak: it comes out after the layers' backward
    (engine/layer/side_inputs.py), when the `boundaries` bytes of boundary activations and the `working` set of the
    layer or the loss phase are gone; what it needs beyond them (the planner's device row of the same name)."""
    return max(0, side_bytes - boundaries - working)


def floor_tile(d: LayerDims, tokens: int, itemsize: int = 2) -> int:
    """The smallest tile worth planning: below it, tiling saves nothing (attention kept whole: the MLP phase
    no longer sets the peak) or little (attention tiled: the tile terms are a small share of the sequence's)."""
    if d.attention_tiled:
        t = TILED_FLOOR_SHARE * tokens * _tiled_seq_bytes(d, itemsize) / _tiled_tile_bytes(d, itemsize)
    else:
        t = tokens * (ATTN_PHASE_H - MLP_PHASE_H) * d.hidden / (TILE_H * d.hidden + TILE_I * d.intermediate)
    return max(MIN_TILE, int(t) // MIN_TILE * MIN_TILE)


def auto_tile(d: LayerDims, tokens: int, itemsize: int, room: int | None) -> int | None:
    """Untiled when that fits `room` (or, with no budget, when the MLP is small); else the tokens halved
    until a tile fits, down to the floor tile."""
    if room is None:
        mlp = tokens * (TILE_H * d.hidden + TILE_I * d.intermediate) * itemsize
        tile = None if mlp < AUTO_MIN_MLP_BYTES else floor_tile(d, tokens, itemsize)
    else:
        tile, floor = None, floor_tile(d, tokens, itemsize)
        while layer_working_bytes(d, tokens, tile, itemsize) > room:
            nxt = (tokens if tile is None else tile) // 2 // MIN_TILE * MIN_TILE
            if nxt <= floor:
                tile = floor
                break
            tile = nxt
    return None if tile is None or tile >= tokens else tile


def auto_loss_chunk(tokens: int, hidden: int, vocab: int, itemsize: int, room: int | None,
                    logits_cap: int | None = AUTO_LOSS_LOGITS_BYTES) -> int:
    """The "auto" head/loss chunk: capped by vocabulary size (`logits_cap` bytes of FP32 logits; None on a
    GPU: MAX_DEVICE_LOSS_CHUNK), then halved until the loss phase fits `room`."""
    if logits_cap is None:
        chunk = MAX_DEVICE_LOSS_CHUNK
    else:
        fits = logits_cap // (vocab * 4)
        chunk = min(DEFAULT_LOSS_CHUNK, max(MIN_LOSS_CHUNK, 1 << (fits.bit_length() - 1) if fits else 0))  # 2^n
    while (room is not None and chunk > MIN_LOSS_CHUNK and chunk < 2 * tokens
           and loss_workspace_bytes(tokens, hidden, vocab, chunk, itemsize) > room):
        chunk = max(MIN_LOSS_CHUNK, chunk // 2)
    return chunk


@dataclass
class BatchPlan:
    offload: bool
    tile: int | None
    predicted_peak_bytes: int
    loss_chunk: int = DEFAULT_LOSS_CHUNK
    in_flight: int = OFFLOAD_IN_FLIGHT  # boundary activations on the device at once when offloaded
    residency: kept.Residency = field(default_factory=kept.Residency)  # layers kept on the device (residency.py)
    side_gradient_bytes: int = 0  # what the side parameters' dense gradient adds to the peak (side_gradient_bytes)


@dataclass
class LongContextPolicy:
    """Chooses, per batch, the MLP tile and whether boundary activations go to host memory."""

    dims: LayerDims
    n_layers: int
    itemsize: int
    vocab: int
    loss_chunk: int | str  # tokens, or "auto"
    tile_setting: int | str | None  # None (untiled), an int, or "auto"
    offload_setting: bool | str  # True, False or "auto"
    budget: int | None  # device bytes; None: no limit
    fixed_bytes: int  # weights resident on the device (layer buffers + embedding/head)
    # "auto" loss chunk: FP32 logits cap per chunk copy (a CPU device), or None to size from the budget (GPU)
    logits_cap: int | None = AUTO_LOSS_LOGITS_BYTES
    residency: str | kept.Residency = field(default_factory=kept.Residency)  # "auto" or counts (residency.py)
    ring_bytes: int = 0  # the streaming buffers (within fixed_bytes), freed when every layer is kept
    # "auto" residency with no device budget (a CPU device: host memory): keep what fits in this many bytes
    # (None: no limit)
    residency_room: int | None = None
    # Layers whose master and Adam state live on the device (engine/update/resident.py), fixed when the engine is
    # built (hold_optimizer): always kept, their state among the fixed bytes.
    optimizer: int = 0
    # Device bytes per parameter of an optimizer-resident layer's state (residency.optimizer_bytes_per_param: more
    # with bf16 gradient slabs, whose device update adds an FP32 work buffer)
    optimizer_bytes: int = kept.OPTIMIZER_BYTES_PER_PARAM
    # The side parameters' dense gradient, bytes (models/side.py side_numel x the compute dtype's itemsize): every
    # training batch's backward holds it after the layers' (side_gradient_bytes); 0 for a model without them
    side_grad_bytes: int = 0
    # The node path's ranks per node where it keeps layers sharded (docs/DISTRIBUTED.md section 4; set by the
    # pipeline's use_weights): a kept layer without a kept graph holds 1/G of its bytes on each device
    kept_share: int = 1
    _weights: int | None = field(default=None, repr=False)  # training's kept weights (planned once, only shrink)
    # "auto" placed by a timing model (costs/advice.py), where the engine was given one: (tokens, optimizer-resident
    # count) -> the placement, or None
    advise: Callable[[int, int], kept.Residency | None] | None = field(default=None, repr=False)
    _advice_refused: bool = field(default=False, repr=False)

    def optimizer_layers(self, reserve_tokens: int = 0, globals_numel: int = 0) -> int:
        """"auto" optimizer residency: how many of the first layers keep their FP32 master, gradients and Adam
        state on the device (residency.OPTIMIZER_BYTES_PER_PARAM), in what the budget leaves after the fixed
        bytes, the working set of a batch of max(OPTIMIZER_RESERVE_TOKENS, `reserve_tokens`) tokens (the engine:
        the model's context window; that state cannot shrink when a batch needs room) and every layer's kept
        weights (the ring
        freed then): weights first, as a kept layer's weights save a copy each way per micro-batch for its
        compute-dtype bytes, and its optimizer state then saves its gradient's copy down, the host's AdamW and the
        copy back up for 16 B/param more. None where not every layer's weights fit. With no budget (a CPU
        device, whose "device" memory is the host's): what fits in `residency_room`. The resident parameters'
        (`globals_numel`) state goes first, with the first layer's (engine/update/resident.py place_globals): no
        layer where it does not fit."""
        globals_state = globals_numel * self.optimizer_bytes
        if self.budget is None:
            if self.residency_room is None:
                return self.n_layers
            return kept.plan_optimizer(self.n_layers, self.dims.numel, 0, max(0, self.residency_room - globals_state),
                                       self.optimizer_bytes)
        with warnings.catch_warnings():  # a budget too small for that batch: no optimizer state, not a warning
            warnings.simplefilter("ignore")
            reserve = self._plan(max(OPTIMIZER_RESERVE_TOKENS, reserve_tokens)).predicted_peak_bytes - self.fixed_bytes
        room = (int(BUDGET_HEADROOM * self.budget) - self.fixed_bytes - reserve
                - self._weights_bytes(self.n_layers) - globals_state)
        if room < 0:
            return 0
        return kept.plan_optimizer(self.n_layers, self.dims.numel, 0, room, self.optimizer_bytes)

    def hold_optimizer(self, count: int, globals_numel: int = 0) -> None:
        """`count` layers (and the resident parameters' `globals_numel`) update on the device from now on: their
        weights join the kept ones of every plan, and under a budget their state the fixed bytes (with none, a CPU
        device's, that state is the host store's, held before any batch as it always was)."""
        self.optimizer = min(count, self.n_layers)
        if self.budget is not None:
            self.fixed_bytes += (self.optimizer * self.dims.numel + globals_numel) * self.optimizer_bytes

    def plan(self, tokens: int, train: bool = True, logits_tokens: int = 0) -> BatchPlan:
        """The batch's plan. A training batch owns the placement: "auto" weights are planned at the first one and
        only shrink, when a training batch's working set needs their room. Any other forward (`train` False: an
        eval, a no-grad forward) uses the layers training keeps and streams the rest: its tile and loss chunk are
        chosen in the room those kept weights leave, and it never changes them. `logits_tokens`: tokens whose full
        logits go back to the caller (no labels, or logits asked for), whose workspace the peak holds."""
        held = None if train else self._held()
        reserved = 0 if held is None else self._weights_bytes(held.weights)
        choice = self._plan(tokens, train, reserved + logits_workspace_bytes(logits_tokens, self.vocab, self.itemsize))
        choice.residency = held if held is not None else self._residency(tokens, choice, train)
        return choice

    def _held(self) -> kept.Residency | None:
        """What a non-training forward finds kept (no graphs): training's placement, counts as set or "auto" as
        the training batches planned it; None before any training batch ("auto": that forward plans its own)."""
        if isinstance(self.residency, kept.Residency):  # counts as set
            return kept.Residency(self.residency.capped(self.n_layers).weights, 0, self.optimizer)
        return None if self._weights is None else kept.Residency(max(self._weights, self.optimizer), 0, self.optimizer)

    def _weights_bytes(self, weights: int) -> int:
        """Device bytes `weights` kept layers add (every layer kept: the ring is freed)."""
        if self.budget is None:
            return 0
        if self.kept_share > 1:  # sharded: 1/G each, and the ring stays (the sharded layers load through it)
            return weights * -(-self.dims.numel * self.itemsize // self.kept_share)
        return weights * self.dims.numel * self.itemsize - (self.ring_bytes if weights == self.n_layers else 0)

    def _residency(self, tokens: int, choice: BatchPlan, train: bool) -> kept.Residency:
        """The batch's residency: fixed counts as set (graphs only where the batch allows them), or "auto"
        within the device room its working set leaves; under a budget its bytes join the predicted peak."""
        allowed = train and choice.tile is None and not choice.offload
        itemsize = self.itemsize
        graph_bytes = layer_graph_bytes(self.dims, tokens, itemsize)
        if isinstance(self.residency, kept.Residency):  # counts as set
            r = self.residency.capped(self.n_layers)
            r = r if allowed else r.without_graphs()
        else:
            if self.budget is None:
                room = self.residency_room
            else:
                room = max(0, int(BUDGET_HEADROOM * self.budget) - choice.predicted_peak_bytes)
            r = kept.plan(self.n_layers, self.dims.numel * itemsize, graph_bytes, room, self.ring_bytes, allowed,
                          self._weights, self.optimizer, self.kept_share)
            r = (self._advised(tokens, room, graph_bytes, allowed) if train else None) or r
            if train:  # the placement is training's; a forward before any training batch plans only for itself
                self._weights = r.weights
        if self.budget is not None:
            # offloaded graphs: only those in flight (residency.OFFLOADED_GRAPHS_IN_FLIGHT), not all of them
            whole = max(r.activations, r.optimizer) if self.kept_share > 1 else 0  # kept whole beside their shards
            rest = self.dims.numel * itemsize - -(-self.dims.numel * itemsize // self.kept_share)
            choice.predicted_peak_bytes += (self._weights_bytes(r.weights) + r.device_graphs * graph_bytes
                                            + whole * rest)
        return r

    def _advised(self, tokens: int, room: int | None, graph_bytes: int, allowed: bool) -> kept.Residency | None:
        """The advisor's placement for a training batch (costs/advice.py), where it fits the `room` this plan
        measured: weights within training's first placement (they only shrink), the optimizer count the engine
        fixed, graphs only where the batch allows them. None: no advisor, no advice, or advice that does not fit
        (the engine's own fill then, said once on the `megatrain` logger)."""
        if self.advise is None or room is None:
            return None
        r = self.advise(tokens, self.optimizer)
        if r is None:
            return None
        cap = self.n_layers if self._weights is None else max(self._weights, self.optimizer)
        need = (r.weights * self.dims.numel * self.itemsize - (self.ring_bytes if r.weights == self.n_layers else 0)
                + r.device_graphs * graph_bytes)
        if r.weights <= cap and r.optimizer == self.optimizer and (allowed or not r.activations) and need <= room:
            return r
        if not self._advice_refused:
            self._advice_refused = True
            log.info("residency: the advised %s does not fit the %d bytes this %d-token batch leaves (or the "
                     "counts fixed before it): the engine's own fill", r.to_dict(), room, tokens)
        return None

    def offloaded_graph_host_bytes(self, tokens: int) -> int:
        """Host bytes the offloaded graphs of a `tokens` batch take (a counts setting; "auto" offloads none)."""
        r = self.residency
        if not isinstance(r, kept.Residency):
            return 0
        return r.capped(self.n_layers).offload * layer_graph_bytes(self.dims, tokens, self.itemsize)

    def _plan(self, tokens: int, train: bool = True, extra: int = 0) -> BatchPlan:
        """`extra`: device bytes held beside the working set all through the batch (the kept weights a
        non-training forward finds, the caller's logits)."""
        boundary = boundary_bytes(self.dims, tokens, self.itemsize)

        def plan_of(off: bool, kept: int, in_flight: int, tile: int | None, chunk: int) -> BatchPlan:
            loss = loss_workspace_bytes(tokens, self.dims.hidden, self.vocab, chunk, self.itemsize)
            working = max(loss, layer_working_bytes(self.dims, tokens, tile, self.itemsize))
            # a no-grad forward has no backward, so no side gradient
            side = side_gradient_bytes(self.side_grad_bytes, kept * boundary, working) if train else 0
            return BatchPlan(off, tile, self.fixed_bytes + extra + kept * boundary + working + side, chunk, in_flight,
                             side_gradient_bytes=side)

        offloads = [self.offload_setting] if isinstance(self.offload_setting, bool) else [False, True]
        # (offload, boundaries kept on the device): resident; offloaded with copies overlapped; without
        # A model no deeper than the boundaries in flight keeps them all anyway: offloaded it holds as many
        # (measured, results/long_context/tiny-32mib), so "auto" does not offload it.
        options = [(off, k) for off in offloads
                   for k in ((OFFLOAD_IN_FLIGHT, OFFLOAD_IN_FLIGHT_TIGHT) if off else (self.n_layers,))
                   if not (off and k >= self.n_layers and not isinstance(self.offload_setting, bool))]
        if not train:  # nothing saved for a backward: nothing to offload
            options = [(False, min(EVAL_BOUNDARIES, self.n_layers))]
        choice = None
        for off, in_flight in options:
            kept = min(in_flight, self.n_layers)
            room = self._room(kept, boundary)
            room = None if room is None else room - extra
            chunk = self.loss_chunk if not isinstance(self.loss_chunk, str) else auto_loss_chunk(  # tokens as set
                tokens, self.dims.hidden, self.vocab, self.itemsize, room, self.logits_cap)
            tile = self._tile(tokens, room)
            choice = plan_of(off, kept, in_flight if off else OFFLOAD_IN_FLIGHT, tile, chunk)
            if self.budget is None or choice.predicted_peak_bytes <= BUDGET_HEADROOM * self.budget:
                return choice
        warnings.warn(f"{tokens} tokens: the predicted device peak {choice.predicted_peak_bytes / 2**30:.2f} GiB "
                      f"exceeds {BUDGET_HEADROOM:.0%} of the device budget {self.budget / 2**30:.2f} GiB even with "
                      f"offload={choice.offload}, tile={choice.tile}; expect an out-of-memory error", stacklevel=3)
        return choice

    def _room(self, kept: int, boundary: int) -> int | None:
        """Device bytes left for one phase's working set (a layer's backward, or the head and loss) with `kept`
        boundary activations on the device."""
        if self.budget is None:
            return None
        return int(BUDGET_HEADROOM * self.budget) - self.fixed_bytes - kept * boundary

    def _tile(self, tokens: int, room: int | None) -> int | None:
        s = self.tile_setting
        if s is None:
            return None
        if not isinstance(s, str):  # a tile as set (the one word is "auto")
            return s if s < tokens else None
        return auto_tile(self.dims, tokens, self.itemsize, room)
