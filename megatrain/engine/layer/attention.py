"""Causal attention over padded or packed batches with no O(tokens²) mask.

HF's `sdpa` path turns any padding (and any packing) into a dense `[batch, 1, seq, seq]` boolean mask:
at 512k tokens that is 256 GiB per sequence, and a mask also keeps SDPA off its flash kernels. Here the
model's mask function (run once per forward, before the layers) describes the batch as segments
instead, and the attention function runs `scaled_dot_product_attention(is_causal=True)` per segment,
so memory stays O(tokens), every call is on the fused kernel, and the layers make no host syncs. The
result is the function HF computes:

- padding: a valid query sees the valid keys at or before it; a padded query sees the valid keys
  before it (zeros when there are none, as SDPA gives for a fully masked row);
- packing (no attention mask, `position_ids` that restart): each document attends only to itself. The
  documents are read off HF's own mask function (a position that may not see its predecessor starts
  one), so detection is exactly HF's, including that an explicit attention mask switches it off.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, causal_mask_function

from ..runtime.host_copy import HostCopy, host_value, to_device

NAME = "megatrain_segments"  # always per segment
AUTO_NAME = "megatrain_segments_auto"  # HF's dense mask while it is small, per segment beyond
# Families whose decoder attention hands the attention function (q, k, v, mask, dropout, scaling, ...)
# with RoPE already applied and the model's mask untouched; checked against HF by the tests.
FAMILIES = ("llama", "qwen2", "mistral", "qwen3")
_UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sliding_window")


# The batch's attention mask in host memory while the model's mask function runs (Engine.forward): the layout's
# control flow (which rows are padded, where the runs are) is read there, so the device is never waited for.
_HOST_MASK: ContextVar[torch.Tensor | None] = ContextVar("megatrain_host_mask", default=None)
# A device batch's attention mask -> its copy in host memory, queued when the batch came in (batch.py check_batch,
# as the labels' copy): read off the device mask, the layout costs a sync per read (7 in a 2-row padded forward).
# Keyed by the tensor's identity, weakly: an entry lives as long as the mask it copies.
_KEPT: WeakIdKeyDictionary = WeakIdKeyDictionary()


def keep_host_mask(mask: torch.Tensor, host: HostCopy | torch.Tensor) -> None:
    """Hand `host_mask` `host`, a copy of `mask` in host memory (to_host's, queued early enough to be done by the
    model's mask function): given `mask` it reads that copy instead of the device. `host` must hold the same values."""
    if host is not mask:  # a host mask is its own copy: nothing to keep (an entry would keep itself alive)
        _KEPT[mask] = host


@contextmanager
def host_mask(mask: torch.Tensor | None) -> Iterator[None]:
    """Within it, a mask function handed the device copy of `mask` reads the layout off `mask` in host memory: the
    copy kept for a device mask (keep_host_mask; its queued copy waited for, not the device's queue), or `mask`
    itself when it is in host memory. A device mask without a copy is read on the device (a sync per read)."""
    kept = None if mask is None else _KEPT.get(mask)
    if kept is not None:
        host = host_value(kept)
    else:
        host = mask if mask is not None and mask.device.type == "cpu" else None
    token = _HOST_MASK.set(host)
    try:
        yield
    finally:
        _HOST_MASK.reset(token)


def _host_starts(mask_function: Any, batch_size: int, s: int) -> torch.Tensor | None:
    """Where each row's documents start, from the mask function evaluated on host indices; None when the
    function reads device tensors of its own (packing by position ids), which only the device can answer."""
    t = torch.arange(s)
    try:
        sees_prev = mask_function(torch.arange(batch_size)[:, None], torch.zeros((), dtype=torch.long), t[None, :],
                                  (t - 1).clamp_min(0)[None, :])
        sees_prev = torch.as_tensor(sees_prev)
    except (RuntimeError, TypeError):
        return None
    return ~sees_prev.expand(batch_size, s) if sees_prev.device.type == "cpu" else None


@dataclass
class Row:
    runs: list[tuple[bool, int, int]]  # (valid, start, length) in position order; one valid run when packed
    docs: list[int] | None  # document lengths when packed
    valid_idx: torch.Tensor | None  # positions of the valid tokens when they are not one slice


@dataclass
class Segments:
    """The batch's attention layout, built once per forward by the mask function."""

    rows: list[Row]
    dense: torch.Tensor | None  # HF's own [b, 1, s, s] bool mask, when "auto" finds it small


def _row(valid: torch.Tensor | None, starts: torch.Tensor | None, s: int) -> Row:
    docs = None
    cuts = [] if starts is None else [c for c in starts.nonzero().squeeze(1).tolist() if c > 0]
    if cuts:
        edges = [0, *cuts, s]
        docs = [b - a for a, b in zip(edges[:-1], edges[1:])]
    if valid is None:
        return Row([(True, 0, s)], docs, None)
    flags, sizes = torch.unique_consecutive(valid, return_counts=True)
    runs, start = [], 0
    for f, n in zip(flags.tolist(), sizes.tolist()):
        runs.append((bool(f), start, n))
        start += n
    several = sum(f for f, _, _ in runs) > 1
    return Row(runs, None, valid.nonzero().squeeze(1) if several else None)


def _segments_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                   mask_function: Any = causal_mask_function, attention_mask: torch.Tensor | None = None,
                   config: Any = None, dtype: torch.dtype = torch.float32, device: Any = "cpu",
                   dense_when_small: bool = False, **kwargs: Any) -> Segments | None:
    """HF mask-interface entry: a `Segments` description, or None for plain causal attention."""
    if q_length != kv_length or q_offset or kv_offset:
        raise ValueError("segment attention is for training (no KV cache): query and key lengths differ")
    s = q_length
    valid = None if attention_mask is None else attention_mask[:, -kv_length:].bool()
    host = _HOST_MASK.get()
    # The same values in host memory (the mask itself for a host batch): every decision below reads these.
    on_host = valid is not None and host is not None and host.shape == attention_mask.shape
    host_valid = host[:, -kv_length:].bool() if on_host else valid  # the same values: the decisions read these
    if valid is not None and bool(host_valid.all()):
        valid = host_valid = None
    # A position its own mask function does not let see its predecessor starts a new segment (packing).
    t = torch.arange(s, device=device)
    b = torch.arange(batch_size, device=device)[:, None]
    sees_prev = mask_function(b, torch.zeros((), dtype=torch.long, device=device), t[None, :],
                              (t - 1).clamp_min(0)[None, :])
    starts = ~torch.as_tensor(sees_prev, device=device).expand(batch_size, s)
    # The decisions below read the starts on the host: from the mask function evaluated there wherever the
    # device is not the host (without a mask too), so reading them costs no device sync.
    host_starts = _host_starts(mask_function, batch_size, s) if on_host or torch.device(device).type != "cpu" else None
    host_starts = starts if host_starts is None else host_starts
    if not bool(host_starts[:, 1:].any()):
        starts = host_starts = None
    if valid is None and starts is None:
        return None
    dense = None
    heads = getattr(config, "num_attention_heads", 1)
    head_dim = getattr(config, "head_dim", None) or getattr(config, "hidden_size", 0) // heads
    # "auto": while the bool mask (s² bytes a row) is no bigger than the queries (s x hidden), memory
    # stays linear, one batched SDPA call beats a loop over segments, and the numerics are HF's own.
    if dense_when_small and s <= heads * head_dim * torch.empty((), dtype=dtype).element_size():
        dense = (t[None, :] <= t[:, None])[None, None].expand(batch_size, 1, s, s)
        if valid is not None:
            dense = dense & valid[:, None, None, :]
        if starts is not None:
            doc = starts.long().cumsum(1)
            dense = dense & (doc[:, None, :, None] == doc[:, None, None, :])
    rows = [_row(None if host_valid is None else host_valid[i], None if host_starts is None else host_starts[i], s)
            for i in range(batch_size)]
    for row in rows:
        if row.valid_idx is not None and row.valid_idx.device != valid.device:
            row.valid_idx = to_device(row.valid_idx, valid.device)
    return Segments(rows, dense)


def expands_kv(q: torch.Tensor) -> bool:
    """Whether grouped key/value heads must be expanded before SDPA: on CUDA only the flash kernel (bf16,
    fp16) takes `enable_gqa`; FP32 with grouped heads would fall to the math kernel, which materialises
    the tokens x tokens scores. The CPU kernels take grouped heads in every dtype."""
    return q.device.type == "cuda" and q.dtype not in (torch.float16, torch.bfloat16)


def kv_for_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                expand: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(k, v, enable_gqa) to hand SDPA: grouped heads as they are where the fused kernels take them, else
    each key/value head repeated for its query heads (query head i reads key/value head i // groups, as
    `enable_gqa` defines it; the copy's backward sums the group's gradients back)."""
    groups = q.shape[1] // k.shape[1]
    if groups == 1:
        return k, v, False
    if expands_kv(q) if expand is None else expand:
        return k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), False
    return k, v, True


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, dropout: float,
          scale: float | None) -> torch.Tensor:
    k, v, gqa = kv_for_sdpa(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scale, is_causal=causal, enable_gqa=gqa)


def _row_pieces(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row: Row, dropout: float,
                scale: float | None) -> list[torch.Tensor]:
    """One row's output as pieces in position order."""
    if row.docs is not None:
        return [_sdpa(qs, ks, vs, True, dropout, scale)
                for qs, ks, vs in zip(q.split(row.docs, 2), k.split(row.docs, 2), v.split(row.docs, 2))]
    valid_runs = [(a, n) for f, a, n in row.runs if f]
    if row.valid_idx is None:  # left or right padding: the valid tokens are a slice, nothing is copied
        a, n = valid_runs[0]
        kc, vc = k[:, :, a: a + n], v[:, :, a: a + n]
        outs = [_sdpa(q[:, :, a: a + n], kc, vc, True, dropout, scale)]
    else:  # holes: attend over the compacted valid tokens, then split back into the runs
        idx = row.valid_idx
        kc, vc = k.index_select(2, idx), v.index_select(2, idx)
        outs = list(_sdpa(q.index_select(2, idx), kc, vc, True, dropout, scale).split([n for _, n in valid_runs], 2))
    pieces, seen = [], 0
    for f, a, n in row.runs:
        if f:
            pieces.append(outs.pop(0))
            seen += n
        elif seen == 0:  # nothing valid before: a fully masked row, which SDPA returns as zeros
            pieces.append(torch.zeros_like(q[:, :, a: a + n]))
        else:  # a padded query sees the valid keys before it
            pieces.append(_sdpa(q[:, :, a: a + n], kc[:, :, :seen], vc[:, :, :seen], False, dropout, scale))
    return pieces


def segment_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: Segments | None, dropout: float = 0.0, scaling: float | None = None,
                              **kwargs: Any) -> tuple[torch.Tensor, None]:
    """HF attention-interface entry: query [b, heads, s, d], key/value [b, kv_heads, s, d] -> [b, s, heads, d]."""
    bad = [k for k in _UNSUPPORTED_KWARGS if kwargs.get(k) is not None]
    if bad:
        raise ValueError(f"segment attention does not model {bad}; use EngineConfig(segment_attention=False)")
    seg = attention_mask
    if expands_kv(query) and key.shape[1] != query.shape[1]:
        key, value, _ = kv_for_sdpa(query, key, value)  # once for every path below, HF's included
    if seg is None:
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling)
    if not isinstance(seg, Segments):
        raise ValueError(f"segment attention expects the mask its own mask function builds, got {type(seg).__name__}")
    if seg.dense is not None:
        return sdpa_attention_forward(module, query, key, value, seg.dense, dropout=dropout, scaling=scaling)
    b, _, s, _ = query.shape
    out = query.new_empty(b, s, query.shape[1], value.shape[-1])
    for i, row in enumerate(seg.rows):
        a = 0
        for piece in _row_pieces(query[i: i + 1], key[i: i + 1], value[i: i + 1], row, dropout, scaling):
            out[i, a: a + piece.shape[2]] = piece[0].transpose(0, 1)  # no concatenated copy of the row
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
    for name, dense in ((NAME, False), (AUTO_NAME, True)):
        AttentionInterface.register(name, segment_attention_forward)
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, partial(_segments_mask, dense_when_small=dense))
    config._attn_implementation = NAME if mode is True else AUTO_NAME  # "auto": dense while it is small
    return True
