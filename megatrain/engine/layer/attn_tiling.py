"""The attention block of a decoder layer over query tiles: exact attention of a tile against its key prefix.

`tiling.py` runs a whole Llama/Qwen2/Mistral/Qwen3 layer over sequence tiles. Its attention side needs,
per query tile [s0, s1), what the untiled layer computes for those rows: the tile's queries against the
keys at positions < s1 (nothing later is visible in a causal layer), with the batch's own layout:

- no mask: plain causal, i.e. causal aligned to the bottom right of the [tile x prefix] block;
- segment attention (`attention.Segments`): per row, per document / valid run / padded run, the same
  key sets and the same causal-or-full choice as `attention._row_pieces`;
- a dense boolean mask (HF's sdpa mask, e.g. Mistral's sliding window, or "auto" segments while small):
  its rows [s0, s1) and columns [0, s1), through HF's own sdpa function.

Bottom-right causal attention of L queries against S > L keys is the last L rows of causal attention
over S. On the CPU it runs as fused flash calls over key blocks (the keys every query sees, unmasked,
then the square diagonal block, causal) merged by their log-sum-exp, and is differentiated block by
block with the merged output and log-sum-exp (the ring-attention identity): no [L x S] mask or score
matrix ever exists, and each block's key/value gradient is added straight into the caller's FP32
accumulators, so no prefix-sized gradient exists either. Elsewhere it is `scaled_dot_product_attention`
with torch's lower-right `CausalBias` (flash / efficient kernels) under autograd. (Not yet run on a GPU.)

Only attention modules whose forward is exactly q/k/v projections (optional Qwen3 q_norm/k_norm on the
head dim), the module's `apply_rotary_pos_emb`, attention, o_proj are tiled; see `attention_tileable`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from .attention import AUTO_NAME, NAME, Segments, kv_for_sdpa

_ATTN_PARAMS = {"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"}
_IMPLEMENTATIONS = ("sdpa", NAME, AUTO_NAME)
_UNMODELED_KWARGS = ("softcap", "s_aux", "position_bias", "output_attentions")


def sub_weights(weights: dict[str, torch.Tensor], part: str) -> dict[str, torch.Tensor]:
    """The weights of submodule `part`, keyed as the submodule names them."""
    prefix = part + "."
    return {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}


def _rope_of(attn: nn.Module) -> Callable | None:
    return getattr(sys.modules.get(type(attn).__module__), "apply_rotary_pos_emb", None)


def attention_module_tileable(attn: nn.Module | None, training: bool = True) -> bool:
    """The call-independent half of `attention_tileable`: the module's structure and settings."""
    if attn is None or _rope_of(attn) is None or not isinstance(getattr(attn, "head_dim", None), int):
        return False
    if any(n.split(".", 1)[0] not in _ATTN_PARAMS for n, _ in attn.named_parameters()):
        return False
    if not all(isinstance(getattr(attn, p, None), nn.Module) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return False
    if getattr(getattr(attn, "config", None), "_attn_implementation", None) not in _IMPLEMENTATIONS:
        return False
    if not getattr(attn, "is_causal", True):
        return False
    # Dropout inside attention: the tiles would draw different random numbers than the untiled layer.
    return not (training and (getattr(attn, "attention_dropout", 0.0) or 0.0) > 0)


def attention_tileable(layer: nn.Module, kwargs: dict) -> bool:
    """Whether this call's attention block can run over query tiles exactly (else: whole, with autograd)."""
    attn = getattr(layer, "self_attn", None)
    if not attention_module_tileable(attn, attn is not None and attn.training):
        return False
    if kwargs.get("is_causal") is False or any(kwargs.get(k) for k in _UNMODELED_KWARGS):
        return False
    pe = kwargs.get("position_embeddings")
    if not (isinstance(pe, (tuple, list)) and len(pe) == 2):
        return False
    mask = kwargs.get("attention_mask")
    if mask is None or isinstance(mask, Segments):
        return True
    return isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.dim() == 4


# -- projections ----------------------------------------------------------------------------------------

def _heads(attn: nn.Module, w: dict, part: str, a: torch.Tensor) -> torch.Tensor:
    """[b, t, hidden] -> the part's projection as [b, t, heads, head_dim] (q_norm / k_norm applied)."""
    y = functional_call(getattr(attn, part), sub_weights(w, part), (a,))
    y = y.view(*a.shape[:-1], -1, attn.head_dim)
    norm = {"q_proj": "q_norm", "k_proj": "k_norm"}.get(part)
    if norm is not None and isinstance(getattr(attn, norm, None), nn.Module):
        y = functional_call(getattr(attn, norm), sub_weights(w, norm), (y,))
    return y


def project_q(attn: nn.Module, w: dict, a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    q = _heads(attn, w, "q_proj", a).transpose(1, 2)
    return _rope_of(attn)(q, q, cos, sin)[0]


def project_kv(attn: nn.Module, w: dict, a: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k = _heads(attn, w, "k_proj", a).transpose(1, 2)
    v = _heads(attn, w, "v_proj", a).transpose(1, 2)
    return _rope_of(attn)(k, k, cos, sin)[1], v


def output_proj(attn: nn.Module, w: dict, o: torch.Tensor) -> torch.Tensor:
    """[b, t, heads, head_dim] attention output -> o_proj, as HF's reshape + o_proj."""
    return functional_call(attn.o_proj, sub_weights(w, "o_proj"), (o.reshape(*o.shape[:2], -1).contiguous(),))


# -- bottom-right causal attention --------------------------------------------------------------------------

_cpu_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_cpu_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
MIN_KEY_BLOCK = 1024  # keys per fused call on the CPU path (and at least 4x the query count)
Sink = Callable[[int, int, torch.Tensor, torch.Tensor], None]  # (key j0, j1, dk block, dv block)


def _spans(s: int, n: int, causal: bool, block: int) -> list[tuple[int, int, bool]]:
    """Key blocks: the keys every query sees, in blocks, then (causal) the square diagonal block."""
    full = s - n if causal else s
    out = [(j, min(j + block, full), False) for j in range(0, full, block)]
    return out + [(full, s, True)] if causal else out


class _CpuBlocks(torch.autograd.Function):
    """q [b, H, L, d] against k, v [b, KV, S, d]: full attention, or (causal) bottom-right causal (query i
    sees keys <= i + S - L), as fused CPU flash calls over key blocks merged by log-sum-exp. Backward
    runs each block's flash backward with the merged output and log-sum-exp; the key/value gradients go
    block by block to `sink` (never a prefix-sized gradient), and k, v get none through autograd."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal, sink):  # noqa: ANN001, ANN205
        spans = _spans(k.shape[2], q.shape[2], causal, max(4 * q.shape[2], MIN_KEY_BLOCK))
        o = lse = None
        for j0, j1, c in spans:
            ob, lb = _cpu_fwd(q, k[:, :, j0:j1], v[:, :, j0:j1], 0.0, c, scale=scale)
            if o is None:
                o, lse = ob, lb
                continue
            new = torch.logaddexp(lse, lb)
            o = o.float().mul_((lse - new).exp_().unsqueeze(-1)).add_(ob.float() * (lb - new).exp_().unsqueeze(-1))
            lse = new
            del ob, lb, new
        o = o.to(q.dtype)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.spans, ctx.scale, ctx.sink = spans, scale, sink
        return o

    @staticmethod
    def backward(ctx, go):  # noqa: ANN001, ANN205
        q, k, v, o, lse = ctx.saved_tensors
        go = go.contiguous()
        dq = None
        for j0, j1, c in ctx.spans:
            dqb, dkb, dvb = _cpu_bwd(go, q, k[:, :, j0:j1], v[:, :, j0:j1], o, lse, 0.0, c, scale=ctx.scale)
            dq = dqb if dq is None else dq.add_(dqb)
            if ctx.sink is not None:
                ctx.sink(j0, j1, dkb, dvb)
            del dqb, dkb, dvb
        return dq, None, None, None, None, None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, causal: bool,
           sink: Sink | None = None) -> torch.Tensor:
    """Attention of q [b, H, L, d] against k, v [b, KV, S, d] (S >= L): full, or causal aligned to the
    bottom right (the last L of S positions). With `sink` (CPU only) the key/value gradients are handed
    to it block by block instead of flowing to k, v."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if q.device.type == "cpu":
        return _CpuBlocks.apply(q, k, v, scale, causal, sink)
    if sink is not None:
        raise ValueError("a gradient sink is only implemented for the CPU path")
    k, v, gqa = kv_for_sdpa(q, k, v)
    if not causal or q.shape[2] == k.shape[2]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
    from torch.nn.attention.bias import causal_lower_right
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]),
                                          scale=scale, enable_gqa=gqa)


def uses_sink(k: torch.Tensor, mask) -> bool:
    """Whether tile_attention can hand key/value gradients to accumulators directly (else: autograd)."""
    dense = isinstance(mask, torch.Tensor) or (isinstance(mask, Segments) and mask.dense is not None)
    return k.device.type == "cpu" and not dense


# -- one query tile ---------------------------------------------------------------------------------------

def _row_plan(row, s0: int, s1: int) -> list[tuple[int, int, slice | torch.Tensor | None, bool]]:
    """Pieces (p0, p1, keys, causal) of one segment row's queries in [s0, s1); keys None: zeros (nothing
    valid before a padded query). Same key sets and modes as `attention._row_pieces`."""
    out = []
    if row.docs is not None:
        a = 0
        for n in row.docs:
            p0, p1 = max(a, s0), min(a + n, s1)
            if p0 < p1:
                out.append((p0, p1, slice(a, p1), True))
            a += n
        return out
    first = next((a for f, a, _ in row.runs if f), None)
    seen = 0
    for f, a, n in row.runs:
        p0, p1 = max(a, s0), min(a + n, s1)
        if p0 < p1:
            if f:
                keys = slice(first, p1) if row.valid_idx is None else row.valid_idx[: seen + p1 - a]
                out.append((p0, p1, keys, True))
            elif seen == 0:
                out.append((p0, p1, None, False))
            else:
                keys = slice(first, first + seen) if row.valid_idx is None else row.valid_idx[:seen]
                out.append((p0, p1, keys, False))
        if f:
            seen += n
    return out


def tile_attention(attn: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, s0: int,
                   scale: float | None, grads: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Queries q [b, H, T, d] at positions [s0, s0 + T) against keys/values [b, KV, >= s0 + T, d]: the
    untiled layer's attention output for those rows, [b, T, H, d]. With `grads` (FP32 dK, dV shaped like
    k, v; only where `uses_sink`), backward adds the key/value gradients into them."""
    b, _, t, _ = q.shape
    s1 = s0 + t
    k, v = k[:, :, :s1], v[:, :, :s1]
    if isinstance(mask, Segments) and mask.dense is not None:
        mask = mask.dense
    if isinstance(mask, torch.Tensor):  # HF's own boolean mask: its rows for this tile, through HF's sdpa
        if grads is not None:
            raise ValueError("dense masks take key/value gradients through autograd")
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(attn, q, k, v, mask[:, :, s0:s1, :s1], dropout=0.0, scaling=scale)[0]
    if mask is None:
        return attend(q, k, v, scale, True, _slice_sink(grads, slice(None), 0)).transpose(1, 2)
    out = q.new_empty(b, t, q.shape[1], v.shape[-1])
    for i, row in enumerate(mask.rows):
        qi, ki, vi = q[i: i + 1], k[i: i + 1], v[i: i + 1]
        for p0, p1, keys, causal in _row_plan(row, s0, s1):
            if keys is None:
                out[i, p0 - s0: p1 - s0] = 0
                continue
            if isinstance(keys, slice):
                kk, vv = ki[:, :, keys], vi[:, :, keys]
                sink = _slice_sink(grads, slice(i, i + 1), keys.start)
            else:
                kk, vv = ki.index_select(2, keys), vi.index_select(2, keys)
                sink = _index_sink(grads, i, keys)
            piece = attend(qi[:, :, p0 - s0: p1 - s0], kk, vv, scale, causal, sink)
            out[i, p0 - s0: p1 - s0] = piece[0].transpose(0, 1)
            del kk, vv, piece
    return out


def _slice_sink(grads: tuple[torch.Tensor, torch.Tensor] | None, rows: slice, start: int) -> Sink | None:
    if grads is None:
        return None
    dk, dv = grads

    def add(j0: int, j1: int, gk: torch.Tensor, gv: torch.Tensor) -> None:
        dk[rows, :, start + j0: start + j1].add_(gk)
        dv[rows, :, start + j0: start + j1].add_(gv)

    return add


def _index_sink(grads: tuple[torch.Tensor, torch.Tensor] | None, row: int, idx: torch.Tensor) -> Sink | None:
    if grads is None:
        return None
    dk, dv = grads

    def add(j0: int, j1: int, gk: torch.Tensor, gv: torch.Tensor) -> None:
        dk[row: row + 1].index_add_(2, idx[j0:j1], gk.to(dk.dtype))
        dv[row: row + 1].index_add_(2, idx[j0:j1], gv.to(dv.dtype))

    return add
