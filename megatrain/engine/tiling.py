"""Sequence tiling inside a decoder layer, and the per-batch long-context plan (tile size, activation offload).

A Llama/Qwen2/Mistral/Qwen3 decoder layer is `h = x + attn(norm1(x)); y = h + mlp(norm2(h))`. Both sides
run over sequence tiles, so nothing `tokens x hidden`-sized beyond a handful of buffers exists at once:

- forward (no autograd): per tile, norm1 and the key/value projections (RoPE on K) fill full-length K,
  V buffers; then per query tile, q (RoPE), attention against the key prefix (attn_tiling.py: exactly
  the untiled layer's causal / padding / packing / sliding-window semantics), o_proj and the residual
  give h for the tile, and the MLP tile adds onto it.
- backward: K, V are recomputed (no autograd) and FP32 dK, dV accumulators allocated; query tiles are
  walked last to first. In causal attention key tile t only gets gradient from query tiles >= t, so
  once query tile t is done its dK, dV are complete: the tile's q-side graph (norm1, q, attention
  against the prefix, o_proj, MLP) is recomputed and differentiated, its prefix dK, dV added, then its
  own k, v are recomputed from x and differentiated with the finished dK, dV. The tile's input gradient
  is then complete and is written over the incoming gradient's tile, which is no longer needed.
  Weight gradients are summed over tiles in FP32.

FLOPs: the untiled recompute's, plus one more norm1 and k/v projection per tile (the no-autograd K, V).
Layers whose attention attn_tiling cannot reproduce exactly (other attention implementations, dropout
inside attention, float masks; `attention_tileable`) keep the attention block whole with autograd and
tile only the MLP, as before. Only layer classes whose forward is exactly the pattern above are tiled
at all (`TILEABLE_LAYERS`, each checked against the untiled layer by the tests).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.func import functional_call

from .attn_tiling import (
    attention_module_tileable,
    attention_tileable,
    output_proj,
    project_kv,
    project_q,
    tile_attention,
    uses_sink,
)

if TYPE_CHECKING:
    from ..config import EngineConfig
    from .templates import TemplateBank

TILEABLE_LAYERS = ("LlamaDecoderLayer", "Qwen2DecoderLayer", "MistralDecoderLayer", "Qwen3DecoderLayer")
_ATTN_PARTS = ("input_layernorm", "self_attn")
_MLP_PARTS = ("post_attention_layernorm", "mlp")
MIN_TILE = 256  # below this the per-tile overhead (Python, kernel launches) outweighs the memory saved
# "auto" with no device budget tiles only once the untiled MLP working set is big enough to matter.
AUTO_MIN_MLP_BYTES = 256 * 2**20


def tileable(layer: nn.Module) -> bool:
    if type(layer).__name__ not in TILEABLE_LAYERS:
        return False
    parts = _ATTN_PARTS + _MLP_PARTS
    if not all(isinstance(getattr(layer, p, None), nn.Module) for p in parts):
        return False
    return all(name.split(".", 1)[0] in parts for name, _ in layer.named_parameters())


def _sub(weights: dict[str, torch.Tensor], part: str) -> dict[str, torch.Tensor]:
    prefix = part + "."
    return {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}


def _attention_block(layer: nn.Module, weights: dict[str, torch.Tensor], x: torch.Tensor, kwargs: dict) -> torch.Tensor:
    kw = {k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values", "past_key_value")}
    a = functional_call(layer.input_layernorm, _sub(weights, "input_layernorm"), (x,))
    a = functional_call(layer.self_attn, _sub(weights, "self_attn"), (), {"hidden_states": a, **kw})
    a = a[0] if isinstance(a, (tuple, list)) else a
    return x + a


def _mlp_block(layer: nn.Module, norm_w: dict, mlp_w: dict, t: torch.Tensor) -> torch.Tensor:
    """The MLP's output for tokens `t`, without the residual."""
    return functional_call(layer.mlp, mlp_w, (functional_call(layer.post_attention_layernorm, norm_w, (t,)),))


def tiled_forward(layer: nn.Module, weights: dict[str, torch.Tensor], x: torch.Tensor, kwargs: dict,
                  tile: int) -> torch.Tensor:
    """The layer's output without autograd, `tile` tokens at a time."""
    if not attention_tileable(layer, kwargs):
        return _mlp_tiled_forward(layer, weights, x, kwargs, tile)
    norm_w, mlp_w = _sub(weights, _MLP_PARTS[0]), _sub(weights, _MLP_PARTS[1])
    k, v = _keys_values(layer, weights, x, kwargs, tile)
    out = torch.empty_like(x)
    for s0, s1 in _tiles(x, tile):
        h = _attention_tile(layer, weights, x[:, s0:s1], k, v, kwargs, s0)
        h.add_(_mlp_block(layer, norm_w, mlp_w, h))  # same op as HF's `residual + hidden_states`
        out[:, s0:s1] = h
        del h
    return out


def tiled_vjp(layer: nn.Module, weights: dict[str, torch.Tensor], x: torch.Tensor, kwargs: dict, g: torch.Tensor,
              tile: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """d<layer(x), g>/dx and /d(each weight, in `weights` order), recomputing the layer one sequence tile
    at a time (see the module docstring). `x` and the weights are leaves that require grad; `g` may be
    overwritten with the result."""
    if not attention_tileable(layer, kwargs):
        return _mlp_tiled_vjp(layer, weights, x, kwargs, g, tile)
    names = list(weights)
    side = {n: n.split(".", 1)[0] for n in names}
    attn_sub = {n: n.split(".")[1] if side[n] == "self_attn" else "" for n in names}
    mlp_names = [n for n in names if side[n] in _MLP_PARTS]
    q_names = [n for n in names if side[n] == "input_layernorm" or attn_sub[n] in ("q_proj", "q_norm", "o_proj")]
    kv_names = [n for n in names if side[n] == "input_layernorm" or attn_sub[n] in ("k_proj", "k_norm", "v_proj")]
    # Sum tile gradients in FP32 so bf16 compute does not lose the small ones.
    acc = {n: torch.zeros(w.shape, dtype=torch.float32, device=w.device) for n, w in weights.items()}

    def add(ns: list[str], gs: list) -> None:
        for n, d in zip(ns, gs):
            if d is not None:
                acc[n].add_(d)

    attn = layer.self_attn
    aw = _sub(weights, "self_attn")
    norm1_w = _sub(weights, "input_layernorm")
    norm_w, mlp_w = _sub(weights, _MLP_PARTS[0]), _sub(weights, _MLP_PARTS[1])
    cos, sin = kwargs["position_embeddings"]
    with torch.no_grad():
        k, v = _keys_values(layer, weights, x, kwargs, tile)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    # The incoming gradient's tile t is last read before dx for tile t is written: reuse it when it is a
    # plain dense tensor of its own (no overlap, no expanded zeros).
    gx = g if g.is_contiguous() and g.dtype == x.dtype and not g.requires_grad else torch.empty_like(x)
    xd = x.detach()
    mask = kwargs.get("attention_mask")
    sink = uses_sink(k, mask)  # key/value gradients straight into dk, dv; else through autograd leaves
    for s0, s1 in reversed(_tiles(x, tile)):
        gt = g[:, s0:s1]
        with torch.enable_grad():
            xt = xd[:, s0:s1].detach().requires_grad_(True)
            kv = [] if sink else [k[:, :, :s1].detach().requires_grad_(True), v[:, :, :s1].detach().requires_grad_(True)]
            h = _attention_tile(layer, weights, xt, *(kv or (k, v)), kwargs, s0, (dk, dv) if sink else None)
            hd = h.detach().requires_grad_(True)
            y = _mlp_block(layer, norm_w, mlp_w, hd)
        g_h, *gws = torch.autograd.grad(y, (hd, *(weights[n] for n in mlp_names)), gt, allow_unused=True)
        add(mlp_names, gws)
        g_h.add_(gt)  # + the residual path
        del y, hd, gws
        gxt, *gws = torch.autograd.grad(h, (xt, *kv, *(weights[n] for n in q_names)), g_h, allow_unused=True)
        del h, g_h
        for acc_kv, d in zip((dk, dv), gws[:len(kv)]):
            if d is not None:  # None: every query of the tile is padding with nothing valid before it
                acc_kv[:, :, :s1].add_(d)
        add(q_names, gws[len(kv):])
        del gws, kv
        # Keys/values of this tile are now complete: through RoPE, k/v projections and norm1 into x.
        with torch.enable_grad():
            xt2 = xd[:, s0:s1].detach().requires_grad_(True)
            a = functional_call(layer.input_layernorm, norm1_w, (xt2,))
            kt, vt = project_kv(attn, aw, a, cos[:, s0:s1], sin[:, s0:s1])
        gxt2, *gws = torch.autograd.grad((kt, vt), (xt2, *(weights[n] for n in kv_names)),
                                         (dk[:, :, s0:s1].to(kt.dtype), dv[:, :, s0:s1].to(vt.dtype)),
                                         allow_unused=True)
        add(kv_names, gws)
        del a, kt, vt, gws
        torch.add(gxt, gxt2, out=gx[:, s0:s1])
        del gxt, gxt2, xt, xt2
    del k, v, dk, dv
    return gx, [acc.pop(n).to(w.dtype) for n, w in weights.items()]


def _tiles(x: torch.Tensor, tile: int) -> list[tuple[int, int]]:
    """Sequence tiles of a [batch, seq, hidden] input holding about `tile` tokens each (all rows)."""
    step = max(1, tile // x.shape[0])
    return [(s, min(s + step, x.shape[1])) for s in range(0, x.shape[1], step)]


def _keys_values(layer: nn.Module, weights: dict, x: torch.Tensor, kwargs: dict,
                 tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's keys (RoPE applied) and values for the whole sequence, [b, kv_heads, seq, head_dim]."""
    attn, aw, norm1_w = layer.self_attn, _sub(weights, "self_attn"), _sub(weights, "input_layernorm")
    cos, sin = kwargs["position_embeddings"]
    k = v = None
    for s0, s1 in _tiles(x, tile):
        a = functional_call(layer.input_layernorm, norm1_w, (x[:, s0:s1].detach(),))
        kt, vt = project_kv(attn, aw, a, cos[:, s0:s1], sin[:, s0:s1])
        if k is None:
            k = kt.new_empty(x.shape[0], kt.shape[1], x.shape[1], kt.shape[-1])
            v = vt.new_empty(x.shape[0], vt.shape[1], x.shape[1], vt.shape[-1])
        k[:, :, s0:s1], v[:, :, s0:s1] = kt, vt
        del a, kt, vt
    return k, v


def _attention_tile(layer: nn.Module, weights: dict, xt: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    kwargs: dict, s0: int, grads: tuple | None = None) -> torch.Tensor:
    """h for the tokens xt at [s0, s0 + T): xt + attn(norm1(xt)) against the keys k, v (positions < s0 + T
    are read); `grads`: see attn_tiling.tile_attention."""
    attn, aw = layer.self_attn, _sub(weights, "self_attn")
    cos, sin = kwargs["position_embeddings"]
    s1 = s0 + xt.shape[1]
    a = functional_call(layer.input_layernorm, _sub(weights, "input_layernorm"), (xt,))
    q = project_q(attn, aw, a, cos[:, s0:s1], sin[:, s0:s1])
    del a
    o = tile_attention(attn, q, k, v, kwargs.get("attention_mask"), s0, getattr(attn, "scaling", None), grads)
    return xt + output_proj(attn, aw, o)


def _mlp_tiled_forward(layer: nn.Module, weights: dict[str, torch.Tensor], x: torch.Tensor, kwargs: dict,
                       tile: int) -> torch.Tensor:
    """The layer's output without autograd, the MLP side `tile` tokens at a time (in place on h)."""
    h = _attention_block(layer, weights, x, kwargs)
    flat = h.view(-1, h.shape[-1])
    norm_w, mlp_w = _sub(weights, _MLP_PARTS[0]), _sub(weights, _MLP_PARTS[1])
    for s in range(0, flat.shape[0], tile):
        t = flat[s: s + tile]
        t.add_(_mlp_block(layer, norm_w, mlp_w, t))  # same op as HF's `residual + hidden_states`
    return h


def _mlp_tiled_vjp(layer: nn.Module, weights: dict[str, torch.Tensor], x: torch.Tensor, kwargs: dict,
                   g: torch.Tensor, tile: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """tiled_vjp for layers whose attention is not tiled: the attention block is recomputed whole with
    autograd, each MLP tile on its own, then the attention block is differentiated."""
    with torch.enable_grad():
        h = _attention_block(layer, weights, x, kwargs)
    mlp_names = [n for n in weights if n.split(".", 1)[0] in _MLP_PARTS]
    mlp_leaves = [weights[n] for n in mlp_names]
    # Sum tile gradients in FP32 so bf16 compute does not lose the small ones.
    acc = [torch.zeros(w.shape, dtype=torch.float32, device=w.device) for w in mlp_leaves]
    norm_w, mlp_w = _sub(weights, _MLP_PARTS[0]), _sub(weights, _MLP_PARTS[1])
    hd = h.detach().view(-1, h.shape[-1])
    gf = g.reshape(-1, g.shape[-1])
    g_h = torch.empty_like(hd)
    for s in range(0, hd.shape[0], tile):
        with torch.enable_grad():
            t = hd[s: s + tile].detach().requires_grad_(True)
            y = _mlp_block(layer, norm_w, mlp_w, t)
        gt, *gws = torch.autograd.grad(y, (t, *mlp_leaves), gf[s: s + tile], allow_unused=True)
        torch.add(gt, gf[s: s + tile], out=g_h[s: s + tile])  # + the residual path
        for a, d in zip(acc, gws):
            if d is not None:
                a.add_(d)
        del t, y, gt, gws
    del hd
    grads = {n: a.to(w.dtype) for n, a, w in zip(mlp_names, acc, mlp_leaves)}
    del acc
    attn_names = [n for n in weights if n not in grads]
    gx, *gas = torch.autograd.grad(h, (x, *(weights[n] for n in attn_names)), g_h.view_as(h), allow_unused=True)
    grads.update(zip(attn_names, gas))
    return gx, [grads[n] if grads[n] is not None else torch.zeros_like(w) for n, w in weights.items()]


# -- the per-batch plan ------------------------------------------------------------------------------

# Peak live elements per token of one layer's recompute + backward, measured with DeviceMemoryTracker
# (Llama shapes, FP32; tests/test_long_context.py checks the prediction).
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
WEIGHT_GRAD_EXTRA = 0.25  # a tile's own weight gradients, as a share of the layer's weights
# The floor tile with tiled attention: tile terms at this share of the sequence terms (smaller saves little).
TILED_FLOOR_SHARE = 0.125
FP32_NORM_H = 1.5  # bf16 compute: the RMSNorms' fp32 upcasts, in fp32 h-vectors per token (planner's figure)
BUDGET_HEADROOM = 0.9  # plan to this share of the budget: allocator fragmentation, estimate error
# Offloaded, the device holds about this many boundary activations at once, whatever the depth (measured):
# a layer's input and output, the next input prefetched, and one on its way out.
OFFLOAD_IN_FLIGHT = 4
LOSS_LOGIT_COPIES = 3  # chunk logits (fp32), their softmax/gradient, and a transient
# "auto" loss chunk: the largest chunk is DEFAULT_LOSS_CHUNK tokens, capped so one FP32 copy of the chunk's
# logits stays under AUTO_LOSS_LOGITS_BYTES (a 128k vocabulary at 2048 tokens would be 1 GiB a copy); with a
# device budget it is halved, down to MIN_LOSS_CHUNK, while the loss phase does not fit. Smaller chunks cost
# only more, smaller head GEMMs.
DEFAULT_LOSS_CHUNK, MIN_LOSS_CHUNK, AUTO_LOSS_LOGITS_BYTES = 2048, 128, 256 * 2**20
# The head + loss phase per token, in h-vectors (measured, FP32): the last layer's output, the final norm's
# output and saved tensors, the valid tokens' copy and its gradient, the gradient scattered back to all
# tokens; during the chunk loop (the chunk's logits on top) and, at its peak, in the final norm's backward.
LOSS_LOOP_H, LOSS_NORM_H = 4.6, 6.5
LOSS_BF16_FP32_H = 3.5  # bf16 compute: the final norm's fp32 upcast and fp32 gradients, in fp32 h-vectors (measured)


@dataclass(frozen=True)
class LayerDims:
    hidden: int
    kv: int  # key/value width (kv_heads x head_dim)
    intermediate: int
    numel: int  # weights of the largest layer
    attention_tiled: bool = True  # whether a tiled layer also tiles its attention block (attn_tiling.py)
    head_dim: int = 128

    @classmethod
    def of(cls, layer: nn.Module, numel: int, hidden: int) -> LayerDims:
        attn = getattr(layer, "self_attn", None)
        k = getattr(attn, "k_proj", None)
        mlp = getattr(layer, "mlp", None)
        up = getattr(mlp, "up_proj", None) or getattr(mlp, "gate_proj", None)
        return cls(hidden, k.weight.shape[0] if k is not None else hidden,
                   up.weight.shape[0] if up is not None else 4 * hidden, numel,
                   tileable(layer) and attention_module_tileable(attn), getattr(attn, "head_dim", None) or 128)


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
    if tile is not None and tile < tokens and d.attention_tiled:
        return int(tokens * _tiled_seq_bytes(d, itemsize) + tile * _tiled_tile_bytes(d, itemsize)
                   + d.numel * (4 + WEIGHT_GRAD_EXTRA * itemsize))
    t = tokens if tile is None else min(tile, tokens)
    kv = KV_PER_TOKEN * d.kv
    attn = tokens * (ATTN_PHASE_H * d.hidden + kv)
    mlp = tokens * (MLP_PHASE_H * d.hidden + kv) + t * (TILE_H * d.hidden + TILE_I * d.intermediate)
    upcasts = tokens * FP32_NORM_H * d.hidden * 4 if itemsize < 4 else 0
    return int(max(attn, mlp) * itemsize + upcasts + d.numel * itemsize)  # + the layer's weight gradients


def loss_workspace_bytes(tokens: int, hidden: int, vocab: int, chunk: int, itemsize: int) -> int:
    """Predicted peak bytes of the head + loss phase beyond the kept boundary activations: the larger of
    the chunk loop (LOSS_LOOP_H plus the chunk's logits) and the final norm's backward after it
    (LOSS_NORM_H), plus the head's FP32 weight gradient."""
    upcasts = tokens * LOSS_BF16_FP32_H * hidden * 4 if itemsize < 4 else 0
    loop = LOSS_LOOP_H * tokens * hidden * itemsize + LOSS_LOGIT_COPIES * min(chunk, tokens) * vocab * 4
    norm = LOSS_NORM_H * tokens * hidden * itemsize
    return int(max(loop, norm) + upcasts + vocab * hidden * 4)


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


def auto_loss_chunk(tokens: int, hidden: int, vocab: int, itemsize: int, room: int | None) -> int:
    """The "auto" head/loss chunk: capped by vocabulary size, then halved until the loss phase fits `room`."""
    fits = AUTO_LOSS_LOGITS_BYTES // (vocab * 4)
    chunk = min(DEFAULT_LOSS_CHUNK, max(MIN_LOSS_CHUNK, 1 << (fits.bit_length() - 1) if fits else 0))  # a power of 2
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

    def plan(self, tokens: int) -> BatchPlan:
        boundary = tokens * self.dims.hidden * self.itemsize

        def peak(offload: bool, tile: int | None, chunk: int) -> int:
            kept = OFFLOAD_IN_FLIGHT if offload else self.n_layers
            loss = loss_workspace_bytes(tokens, self.dims.hidden, self.vocab, chunk, self.itemsize)
            return (self.fixed_bytes + kept * boundary
                    + max(loss, layer_working_bytes(self.dims, tokens, tile, self.itemsize)))

        offloads = [self.offload_setting] if isinstance(self.offload_setting, bool) else [False, True]
        choice = None
        for off in offloads:
            room = self._room(off, boundary)
            chunk = self.loss_chunk if self.loss_chunk != "auto" else auto_loss_chunk(
                tokens, self.dims.hidden, self.vocab, self.itemsize, room)
            tile = self._tile(tokens, room)
            choice = BatchPlan(off, tile, peak(off, tile, chunk), chunk)
            if self.budget is None or choice.predicted_peak_bytes <= BUDGET_HEADROOM * self.budget:
                return choice
        warnings.warn(f"{tokens} tokens: the predicted device peak {choice.predicted_peak_bytes / 2**30:.2f} GiB "
                      f"exceeds {BUDGET_HEADROOM:.0%} of the device budget {self.budget / 2**30:.2f} GiB even with "
                      f"offload={choice.offload}, tile={choice.tile}; expect an out-of-memory error", stacklevel=3)
        return choice

    def _room(self, offload: bool, boundary: int) -> int | None:
        """Device bytes left for one phase's working set (a layer's backward, or the head and loss)."""
        if self.budget is None:
            return None
        kept = OFFLOAD_IN_FLIGHT if offload else self.n_layers
        return int(BUDGET_HEADROOM * self.budget) - self.fixed_bytes - kept * boundary

    def _tile(self, tokens: int, room: int | None) -> int | None:
        s = self.tile_setting
        if s is None:
            return None
        if s != "auto":
            return s if s < tokens else None
        return auto_tile(self.dims, tokens, self.itemsize, room)


def long_context_policy(config: EngineConfig, templates: TemplateBank, layer_numels: list[int], num_buffers: int,
                        device: torch.device, dtype: torch.dtype, globals_bytes: int, head: torch.Size) -> LongContextPolicy:
    """The policy for an engine: its largest layer's shapes, resident weights and device budget."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    big = max(range(len(layer_numels)), key=layer_numels.__getitem__)
    budget = config.device_budget_bytes
    if budget is None and device.type == "cuda":
        budget = torch.cuda.get_device_properties(device).total_memory
    return LongContextPolicy(
        dims=LayerDims.of(templates.of_layer[big], layer_numels[big], head[1]), n_layers=len(layer_numels),
        itemsize=itemsize, vocab=head[0], loss_chunk=config.loss_chunk_tokens, tile_setting=config.mlp_tile_tokens,
        offload_setting=config.offload_activations, budget=budget,
        fixed_bytes=num_buffers * layer_numels[big] * itemsize + globals_bytes)
