"""Sequence tiling inside a decoder layer, and the per-batch long-context plan (tile size, activation offload).

A Llama/Qwen2/Mistral-style decoder layer is `h = x + attn(norm1(x)); y = h + mlp(norm2(h))`. The MLP
side is per token, so it can run over tiles of the (flattened) tokens: the `tokens x intermediate`
activations (gate, up, their product and, in backward, their gradients) then exist for one tile at a
time. Attention stays whole on `scaled_dot_product_attention`, whose fused kernels are O(tokens).

Backward is a tiled recompute: the attention block is recomputed with autograd, then each MLP tile is
recomputed and differentiated on its own (its weight gradients summed over tiles), and finally the
attention block is differentiated with the gradient the tiles produced. The MLP is computed once per
tile, as in the untiled recompute, so tiling adds no FLOPs.

Only layer classes whose forward is exactly the pattern above are tiled (`TILEABLE_LAYERS`, each checked
against the untiled layer by the tests); any other layer runs untiled.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.func import functional_call

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
    """The layer's output without autograd, the MLP side `tile` tokens at a time (in place on h)."""
    h = _attention_block(layer, weights, x, kwargs)
    flat = h.view(-1, h.shape[-1])
    norm_w, mlp_w = _sub(weights, _MLP_PARTS[0]), _sub(weights, _MLP_PARTS[1])
    for s in range(0, flat.shape[0], tile):
        t = flat[s: s + tile]
        t.add_(_mlp_block(layer, norm_w, mlp_w, t))  # same op as HF's `residual + hidden_states`
    return h


def tiled_vjp(layer: nn.Module, weights: dict[str, torch.Tensor], x: torch.Tensor, kwargs: dict, g: torch.Tensor,
              tile: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """d<layer(x), g>/dx and /d(each weight, in `weights` order), recomputing the layer with only one
    MLP tile's activations alive at a time. `x` and the weights are leaves that require grad."""
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
# (Llama shapes, FP32; tests/test_long_context.py checks the prediction). The peak is the larger of:
#  - the attention backward: 11 h + 2 kv per token (the recomputed attention graph, its gradients);
#  - an MLP tile's backward: 9 h + 2 kv per token (the attention graph, kept meanwhile) plus, per token
#    of the tile, 2 h + 6 I (norm2 in/out; gate, up, their product and gradients).
# Untiled (tile = all tokens) that is 11 h + 2 kv + 6 I, from the MLP phase.
ATTN_PHASE_H, KV_PER_TOKEN, MLP_PHASE_H = 11.0, 2.0, 9.0
TILE_H, TILE_I = 2.0, 6.0
FP32_NORM_H = 1.5  # bf16 compute: the RMSNorms' fp32 upcasts, in fp32 h-vectors per token (planner's figure)
BUDGET_HEADROOM = 0.9  # plan to this share of the budget: allocator fragmentation, estimate error
# Offloaded, the device holds about this many boundary activations at once, whatever the depth (measured):
# a layer's input and output, the next input prefetched, and one on its way out.
OFFLOAD_IN_FLIGHT = 4
LOSS_LOGIT_COPIES = 3  # chunk logits (fp32), their softmax/gradient, and a transient


@dataclass(frozen=True)
class LayerDims:
    hidden: int
    kv: int  # key/value width (kv_heads x head_dim)
    intermediate: int
    numel: int  # weights of the largest layer

    @classmethod
    def of(cls, layer: nn.Module, numel: int, hidden: int) -> LayerDims:
        attn = getattr(layer, "self_attn", None)
        k = getattr(attn, "k_proj", None)
        mlp = getattr(layer, "mlp", None)
        up = getattr(mlp, "up_proj", None) or getattr(mlp, "gate_proj", None)
        return cls(hidden, k.weight.shape[0] if k is not None else hidden,
                   up.weight.shape[0] if up is not None else 4 * hidden, numel)


def layer_working_bytes(d: LayerDims, tokens: int, tile: int | None, itemsize: int) -> int:
    """Predicted peak bytes one layer's backward adds on the device, beyond its input and weights."""
    t = tokens if tile is None else min(tile, tokens)
    kv = KV_PER_TOKEN * d.kv
    attn = tokens * (ATTN_PHASE_H * d.hidden + kv)
    mlp = tokens * (MLP_PHASE_H * d.hidden + kv) + t * (TILE_H * d.hidden + TILE_I * d.intermediate)
    upcasts = tokens * FP32_NORM_H * d.hidden * 4 if itemsize < 4 else 0
    return int(max(attn, mlp) * itemsize + upcasts + d.numel * itemsize)  # + the layer's weight gradients


def loss_workspace_bytes(tokens: int, hidden: int, vocab: int, chunk: int, itemsize: int) -> int:
    return int(2 * tokens * hidden * itemsize + LOSS_LOGIT_COPIES * min(chunk, tokens) * vocab * 4 + vocab * hidden * 4)


def floor_tile(d: LayerDims, tokens: int) -> int:
    """The largest tile at which the MLP phase no longer sets the layer's peak: smaller saves nothing."""
    t = tokens * (ATTN_PHASE_H - MLP_PHASE_H) * d.hidden / (TILE_H * d.hidden + TILE_I * d.intermediate)
    return max(MIN_TILE, int(t) // MIN_TILE * MIN_TILE)


def auto_tile(d: LayerDims, tokens: int, itemsize: int, room: int | None) -> int | None:
    """Untiled when that fits `room` (or, with no budget, when the MLP is small); else the tokens halved
    until a tile fits, down to the floor tile."""
    if room is None:
        mlp = tokens * (TILE_H * d.hidden + TILE_I * d.intermediate) * itemsize
        tile = None if mlp < AUTO_MIN_MLP_BYTES else floor_tile(d, tokens)
    else:
        tile, floor = None, floor_tile(d, tokens)
        while layer_working_bytes(d, tokens, tile, itemsize) > room:
            nxt = (tokens if tile is None else tile) // 2 // MIN_TILE * MIN_TILE
            if nxt <= floor:
                tile = floor
                break
            tile = nxt
    return None if tile is None or tile >= tokens else tile


@dataclass
class BatchPlan:
    offload: bool
    tile: int | None
    predicted_peak_bytes: int


@dataclass
class LongContextPolicy:
    """Chooses, per batch, the MLP tile and whether boundary activations go to host memory."""

    dims: LayerDims
    n_layers: int
    itemsize: int
    vocab: int
    loss_chunk: int
    tile_setting: int | str | None  # None (untiled), an int, or "auto"
    offload_setting: bool | str  # True, False or "auto"
    budget: int | None  # device bytes; None: no limit
    fixed_bytes: int  # weights resident on the device (layer buffers + embedding/head)

    def plan(self, tokens: int) -> BatchPlan:
        boundary = tokens * self.dims.hidden * self.itemsize
        loss = loss_workspace_bytes(tokens, self.dims.hidden, self.vocab, self.loss_chunk, self.itemsize)

        def peak(offload: bool, tile: int | None) -> int:
            kept = OFFLOAD_IN_FLIGHT if offload else self.n_layers
            return (self.fixed_bytes + kept * boundary
                    + max(loss, layer_working_bytes(self.dims, tokens, tile, self.itemsize)))

        offloads = [self.offload_setting] if isinstance(self.offload_setting, bool) else [False, True]
        choice = None
        for off in offloads:
            tile = self._tile(tokens, off, boundary)
            choice = BatchPlan(off, tile, peak(off, tile))
            if self.budget is None or choice.predicted_peak_bytes <= BUDGET_HEADROOM * self.budget:
                return choice
        warnings.warn(f"{tokens} tokens: the predicted device peak {choice.predicted_peak_bytes / 2**30:.2f} GiB "
                      f"exceeds {BUDGET_HEADROOM:.0%} of the device budget {self.budget / 2**30:.2f} GiB even with "
                      f"offload={choice.offload}, tile={choice.tile}; expect an out-of-memory error", stacklevel=3)
        return choice

    def _tile(self, tokens: int, offload: bool, boundary: int) -> int | None:
        s = self.tile_setting
        if s is None:
            return None
        if s != "auto":
            return s if s < tokens else None
        room = None
        if self.budget is not None:
            kept = OFFLOAD_IN_FLIGHT if offload else self.n_layers
            room = int(BUDGET_HEADROOM * self.budget) - self.fixed_bytes - kept * boundary
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
