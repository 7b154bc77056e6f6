"""Causal attention over padded or packed batches with no O(tokens²) mask.

HF's `sdpa` path turns any padding (and any packing) into a dense `[batch, 1, seq, seq]` boolean mask:
at 512k tokens that is 256 GiB per sequence, and a mask also keeps SDPA off its flash kernels. This
implementation takes the 2-D padding mask (or packed `position_ids`) as is and runs
`scaled_dot_product_attention(is_causal=True)` per segment, so memory stays O(tokens) and every call
is on the fused kernel. The result is the same function HF computes:

- padding: a valid query sees the valid keys at or before it; a padded query sees the valid keys
  before it (zeros when there are none, as SDPA gives for a fully masked row);
- packing (no attention mask, `position_ids` that restart): each document attends only to itself,
  detected exactly as `transformers.masking_utils.find_packed_sequence_indices` does. As in HF, an
  explicit attention mask switches packing detection off.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, find_packed_sequence_indices

NAME = "megatrain_segments"  # always per segment
AUTO_NAME = "megatrain_segments_auto"  # HF's dense mask while it is small, per segment beyond
# Families whose decoder attention hands the attention function exactly (q, k, v, mask, dropout,
# scaling, position_ids, ...) with RoPE already applied; checked against HF by the tests.
FAMILIES = ("llama", "qwen2", "mistral", "qwen3")
_UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sliding_window")


def _mask_2d(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
             mask_function: Any = None, attention_mask: torch.Tensor | None = None, **kwargs: Any):
    # Keep the caller's 2-D mask (already bool) as is; None means "no mask given", which is what
    # decides whether packed position_ids are honoured.
    return None if attention_mask is None else attention_mask[:, -kv_length:]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, dropout: float,
          scale: float | None) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scale, is_causal=causal,
                                          enable_gqa=k.shape[1] != q.shape[1])


def _packed_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: torch.Tensor, dropout: float,
                scale: float | None) -> list[torch.Tensor]:
    sizes = torch.unique_consecutive(docs, return_counts=True)[1].tolist()
    return [_sdpa(qs, ks, vs, True, dropout, scale) for qs, ks, vs in zip(q.split(sizes, 2), k.split(sizes, 2),
                                                                          v.split(sizes, 2))]


def _padded_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, dropout: float,
                scale: float | None) -> list[torch.Tensor]:
    """The row's output as pieces in position order, over runs of valid and padded tokens."""
    flags, sizes = torch.unique_consecutive(valid, return_counts=True)
    runs, start = [], 0
    for f, n in zip(flags.tolist(), sizes.tolist()):
        runs.append((f, start, n))
        start += n
    valid_runs = [(a, n) for f, a, n in runs if f]
    if len(valid_runs) == 1:  # left or right padding: the valid tokens are a slice, nothing is copied
        a, n = valid_runs[0]
        kc, vc, outs = k[:, :, a: a + n], v[:, :, a: a + n], [_sdpa(q[:, :, a: a + n], k[:, :, a: a + n],
                                                                     v[:, :, a: a + n], True, dropout, scale)]
    else:  # holes: attend over the compacted valid tokens, then split back into the runs
        idx = valid.nonzero().squeeze(1)
        kc, vc = k.index_select(2, idx), v.index_select(2, idx)
        outs = list(_sdpa(q.index_select(2, idx), kc, vc, True, dropout, scale).split([n for _, n in valid_runs], 2))
    pieces, seen = [], 0
    for f, a, n in runs:
        if f:
            pieces.append(outs.pop(0))
            seen += n
        elif seen == 0:  # nothing valid before: a fully masked row, which SDPA returns as zeros
            pieces.append(torch.zeros_like(q[:, :, a: a + n]))
        else:  # a padded query sees the valid keys before it
            pieces.append(_sdpa(q[:, :, a: a + n], kc[:, :, :seen], vc[:, :, :seen], False, dropout, scale))
    return pieces


def _dense_mask(valid: torch.Tensor | None, docs: torch.Tensor | None, s: int, device: torch.device) -> torch.Tensor:
    # What HF's sdpa_mask builds: key <= query, and the key is valid / in the query's document.
    i = torch.arange(s, device=device)
    mask = (i[None, :] <= i[:, None])[None, None]
    if valid is not None:
        mask = mask & valid[:, None, None, :]
    if docs is not None:
        mask = mask & (docs[:, None, :, None] == docs[:, None, None, :])
    return mask


def segment_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                              position_ids: torch.Tensor | None = None, dense_when_small: bool = False,
                              **kwargs: Any) -> tuple[torch.Tensor, None]:
    """HF attention-interface entry: query [b, heads, s, d], key/value [b, kv_heads, s, d] -> [b, s, heads, d]."""
    bad = [k for k in _UNSUPPORTED_KWARGS if kwargs.get(k) is not None]
    if bad:
        raise ValueError(f"segment attention does not model {bad}; use EngineConfig(segment_attention=False)")
    b, _, s, _ = query.shape
    if key.shape[2] != s:
        raise ValueError("segment attention is for training (no KV cache): query and key lengths differ")
    valid = docs = None
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(f"segment attention expects a 2-D padding mask, got shape {tuple(attention_mask.shape)}")
        valid = attention_mask.bool()
        if bool(valid.all()):
            valid = None
    elif position_ids is not None:
        docs = find_packed_sequence_indices(position_ids.expand(b, -1))
    if valid is None and docs is None:
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling)
    # "auto": while the bool mask (s² bytes per row) is no bigger than the query itself (s x hidden),
    # memory stays linear, one batched SDPA call beats a loop over segments, and the numerics are HF's own.
    if dense_when_small and s <= query.shape[1] * query.shape[3] * query.element_size():
        mask = _dense_mask(valid, docs, s, query.device)
        return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling)
    out = query.new_empty(b, s, query.shape[1], value.shape[-1])
    for i in range(b):
        row = (_padded_row if valid is not None else _packed_row)(
            query[i: i + 1], key[i: i + 1], value[i: i + 1], valid[i] if valid is not None else docs[i], dropout,
            scaling)
        a = 0
        for piece in row:  # written straight into the output: no concatenated copy of the whole row
            out[i, a: a + piece.shape[2]] = piece[0].transpose(0, 1)
            a += piece.shape[2]
    return out, None


def supports_segment_attention(config: Any) -> bool:
    """True when the model's attention is plain causal SDPA over full (not sliding/chunked) windows."""
    if getattr(config, "model_type", None) not in FAMILIES:
        return False
    if getattr(config, "_attn_implementation", None) not in ("sdpa", NAME, AUTO_NAME):
        return False
    if not getattr(config, "is_causal", True):
        return False
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return False
    window = getattr(config, "sliding_window", None)
    return window is None or not getattr(config, "use_sliding_window", True)


def use_segment_attention(config: Any, mode: bool | str = True) -> bool:
    """Switch a supported model's attention to segment attention (mode True: always; "auto": once HF's
    dense mask would outgrow the hidden states); return whether it was switched."""
    if not mode or not supports_segment_attention(config):
        return False
    AttentionInterface.register(NAME, segment_attention_forward)
    AttentionInterface.register(AUTO_NAME, partial(segment_attention_forward, dense_when_small=True))
    for name in (NAME, AUTO_NAME):
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, _mask_2d)
    config._attn_implementation = AUTO_NAME if mode == "auto" else NAME
    return True
