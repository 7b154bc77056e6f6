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

import dataclasses
import os
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.func import functional_call

# The memory model lives in costs/memory.py (torch-free, shared with the planner); its names are re-exported here.
from ...costs.memory import (  # noqa: F401
    ATTN_PHASE_H,
    AUTO_LOSS_LOGITS_BYTES,
    AUTO_MIN_MLP_BYTES,
    BUDGET_HEADROOM,
    DEFAULT_LOSS_CHUNK,
    FP32_NORM_H,
    KV_PER_TOKEN,
    LOSS_BF16_FP32_H,
    LOSS_LOGIT_COPIES,
    LOSS_LOOP_H,
    LOSS_NORM_H,
    MIN_LOSS_CHUNK,
    MIN_TILE,
    MLP_PHASE_H,
    OFFLOAD_IN_FLIGHT,
    TILE_ATTN_H,
    TILE_H,
    TILE_I,
    TILED_AROUND_H,
    TILED_FLOOR_SHARE,
    TILED_KV_BUFFERS,
    TILED_ROPE_HEAD_DIM,
    WEIGHT_GRAD_EXTRA,
    BatchPlan,
    LayerDims,
    LongContextPolicy,
    auto_loss_chunk,
    auto_tile,
    floor_tile,
    layer_working_bytes,
    loss_workspace_bytes,
    residual_streams,
)
from ...costs.residency import optimizer_bytes_per_param
from ...models.side import side_numel  # noqa: F401  (the engine counts its model's side parameters through here)
from ..host.preflight import available_host_bytes
from .attn_tiling import (
    attention_module_tileable,
    attention_tileable,
    output_proj,
    project_kv,
    project_q,
    sub_weights,
    tile_attention,
    uses_sink,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ...config.schema import EngineConfig

TILEABLE_LAYERS = ("LlamaDecoderLayer", "Qwen2DecoderLayer", "MistralDecoderLayer", "Qwen3DecoderLayer")
_ATTN_PARTS = ("input_layernorm", "self_attn")
_MLP_PARTS = ("post_attention_layernorm", "mlp")


def tileable(layer: nn.Module) -> bool:
    if type(layer).__name__ not in TILEABLE_LAYERS:
        return False
    parts = _ATTN_PARTS + _MLP_PARTS
    if not all(isinstance(getattr(layer, p, None), nn.Module) for p in parts):
        return False
    return all(name.split(".", 1)[0] in parts for name, _ in layer.named_parameters())


def _attention_block(layer: nn.Module, weights: dict[str, torch.Tensor], x: torch.Tensor, kwargs: dict) -> torch.Tensor:
    kw = {k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values", "past_key_value")}
    a = functional_call(layer.input_layernorm, sub_weights(weights, "input_layernorm"), (x,))
    a = functional_call(layer.self_attn, sub_weights(weights, "self_attn"), (), {"hidden_states": a, **kw})
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
    norm_w, mlp_w = sub_weights(weights, _MLP_PARTS[0]), sub_weights(weights, _MLP_PARTS[1])
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
    names = [n for n, w in weights.items() if w.requires_grad]  # a frozen weight (trainable.py): no gradient
    side = {n: n.split(".", 1)[0] for n in names}
    attn_sub = {n: n.split(".")[1] if side[n] == "self_attn" else "" for n in names}
    mlp_names = [n for n in names if side[n] in _MLP_PARTS]
    q_names = [n for n in names if side[n] == "input_layernorm" or attn_sub[n] in ("q_proj", "q_norm", "o_proj")]
    kv_names = [n for n in names if side[n] == "input_layernorm" or attn_sub[n] in ("k_proj", "k_norm", "v_proj")]
    # Sum tile gradients in FP32 so bf16 compute does not lose the small ones.
    acc = {n: torch.zeros(weights[n].shape, dtype=torch.float32, device=weights[n].device) for n in names}

    def add(ns: list[str], gs: list) -> None:
        for n, d in zip(ns, gs):
            if d is not None:
                acc[n].add_(d)

    attn = layer.self_attn
    aw = sub_weights(weights, "self_attn")
    norm1_w = sub_weights(weights, "input_layernorm")
    norm_w, mlp_w = sub_weights(weights, _MLP_PARTS[0]), sub_weights(weights, _MLP_PARTS[1])
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
    return gx, [acc.pop(n).to(w.dtype) if n in acc else None for n, w in weights.items()]


def _tiles(x: torch.Tensor, tile: int) -> list[tuple[int, int]]:
    """Sequence tiles of a [batch, seq, hidden] input holding about `tile` tokens each (all rows)."""
    step = max(1, tile // x.shape[0])
    return [(s, min(s + step, x.shape[1])) for s in range(0, x.shape[1], step)]


def _keys_values(layer: nn.Module, weights: dict, x: torch.Tensor, kwargs: dict,
                 tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's keys (RoPE applied) and values for the whole sequence, [b, kv_heads, seq, head_dim]."""
    attn, aw, norm1_w = layer.self_attn, sub_weights(weights, "self_attn"), sub_weights(weights, "input_layernorm")
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
    attn, aw = layer.self_attn, sub_weights(weights, "self_attn")
    cos, sin = kwargs["position_embeddings"]
    s1 = s0 + xt.shape[1]
    a = functional_call(layer.input_layernorm, sub_weights(weights, "input_layernorm"), (xt,))
    q = project_q(attn, aw, a, cos[:, s0:s1], sin[:, s0:s1])
    del a
    o = tile_attention(attn, q, k, v, kwargs.get("attention_mask"), s0, getattr(attn, "scaling", None), grads)
    return xt + output_proj(attn, aw, o)


def _mlp_tiled_forward(layer: nn.Module, weights: dict[str, torch.Tensor], x: torch.Tensor, kwargs: dict,
                       tile: int) -> torch.Tensor:
    """The layer's output without autograd, the MLP side `tile` tokens at a time (in place on h)."""
    h = _attention_block(layer, weights, x, kwargs)
    flat = h.view(-1, h.shape[-1])
    norm_w, mlp_w = sub_weights(weights, _MLP_PARTS[0]), sub_weights(weights, _MLP_PARTS[1])
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
    mlp_names = [n for n in weights if n.split(".", 1)[0] in _MLP_PARTS and weights[n].requires_grad]
    mlp_leaves = [weights[n] for n in mlp_names]
    # Sum tile gradients in FP32 so bf16 compute does not lose the small ones.
    acc = [torch.zeros(w.shape, dtype=torch.float32, device=w.device) for w in mlp_leaves]
    norm_w, mlp_w = sub_weights(weights, _MLP_PARTS[0]), sub_weights(weights, _MLP_PARTS[1])
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
    attn_names = [n for n, w in weights.items() if n not in grads and w.requires_grad and
                  n.split(".", 1)[0] not in _MLP_PARTS]
    gx, *gas = torch.autograd.grad(h, (x, *(weights[n] for n in attn_names)), g_h.view_as(h), allow_unused=True)
    grads.update(zip(attn_names, gas))
    return gx, [None if n not in grads else grads[n] if grads[n] is not None else torch.zeros_like(w)
                for n, w in weights.items()]


def layer_streams(layer: nn.Module) -> int:
    """The residual streams a decoder layer passes on (hyper-connections' hc_mult, DeepSeek-V4), read as the planner
    reads it (costs/memory.py residual_streams): off the config the layer or its attention keeps, else off a
    hyper-connection module of the layer (its `hc_mult`); 1 for a plain layer."""
    for owner in (layer, getattr(layer, "self_attn", None)):
        cfg = getattr(owner, "config", None)
        if cfg is not None and residual_streams(cfg) > 1:
            return residual_streams(cfg)
    return max((residual_streams(m) for m in layer.modules()), default=1)


def layer_dims(layer: nn.Module, numel: int, hidden: int) -> LayerDims:
    """The memory model's shapes of a decoder layer (and whether its attention block tiles; its residual streams:
    a boundary's activation is that many hidden-wide vectors per token)."""
    attn = getattr(layer, "self_attn", None)
    k = getattr(attn, "k_proj", None)
    mlp = getattr(layer, "mlp", None)
    up = getattr(mlp, "up_proj", None) or getattr(mlp, "gate_proj", None)
    return LayerDims(hidden, k.weight.shape[0] if k is not None else hidden,
                     up.weight.shape[0] if up is not None else 4 * hidden, numel,
                     tileable(layer) and attention_module_tileable(attn), getattr(attn, "head_dim", None) or 128,
                     streams=layer_streams(layer))


def long_context_policy(config: EngineConfig, layers: Sequence[nn.Module], layer_numels: list[int], num_buffers: int,
                        device: torch.device, dtype: torch.dtype, globals_bytes: int, head: torch.Size,
                        side: int = 0) -> LongContextPolicy:
    """The policy for an engine: its largest layer's shapes, resident weights and device budget (`layers`: one
    module per decoder layer, e.g. the engine's templates, read for shapes only). `side`: the model's side
    parameters (side_numel: Gemma 3n/4's per-layer input table and projection), whose dense gradient in the compute
    dtype every training batch's backward holds after the layers' (the planner's device row of that name)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    big = max(range(len(layer_numels)), key=layer_numels.__getitem__)
    budget = config.device_budget_bytes
    if budget is None and device.type == "cuda":
        budget = free_device_bytes(device, globals_bytes)
    dims = layer_dims(layers[big], layer_numels[big], head[1])
    q = getattr(getattr(layers[big], "self_attn", None), "q_proj", None)
    if q is not None and device.type == "cuda" and itemsize == 4:  # attention.expands_kv
        dims = dataclasses.replace(dims, kv_expanded=max(0, q.weight.shape[0] - dims.kv))
    return LongContextPolicy(
        dims=dims, n_layers=len(layer_numels),
        itemsize=itemsize, vocab=head[0], loss_chunk=config.loss_chunk_tokens, tile_setting=config.mlp_tile_tokens,
        offload_setting=config.offload_activations, budget=budget,
        fixed_bytes=num_buffers * layer_numels[big] * itemsize + globals_bytes,
        logits_cap=None if device.type == "cuda" else AUTO_LOSS_LOGITS_BYTES,
        residency=config.residency, ring_bytes=num_buffers * layer_numels[big] * itemsize,
        residency_room=host_room() if budget is None else None,
        # what an optimizer-resident layer's state takes as the engine allocates it: a bf16 slab adds an FP32 work buffer
        optimizer_bytes=optimizer_bytes_per_param(2 if config.host_grad_dtype == "bfloat16" else 4),
        side_grad_bytes=side * itemsize)


def free_device_bytes(device: torch.device, own_bytes: int) -> int:
    """The device budget when none is set: what the device has free now (`torch.cuda.mem_get_info`, so memory
    another process on the same GPU holds is not counted), what this process's allocator caches unused, and the
    engine's own device bytes already placed (`own_bytes`, which the plan counts in its fixed bytes). Not the
    card's total: a co-located process (a rollout server) would leave the plan more room than there is."""
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free + max(0, cached) + own_bytes)


def host_room() -> int:
    """What "auto" residency may keep with no device budget on a CPU device, whose "device" memory is the host's:
    half of what this process may still allocate (the rest for the batch's working set and the page cache),
    shared among the node's ranks (each keeps its own copies)."""
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return available_host_bytes() // (2 * max(1, ranks))
