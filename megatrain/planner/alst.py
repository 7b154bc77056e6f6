"""Device memory of DeepSpeed ZeRO-3 offload with its ALST long-sequence pieces (the `zero3-alst` backend).

What that configuration keeps on the device at one micro-batch of T tokens (c = bytes of the compute
dtype), term by term as baselines/alst.py sets it up on top of the lean ZeRO-3 settings:
  - one module's parameters fetched at a time (nothing kept gathered, no prefetch): the largest is the
    embedding / tied head, V x h;
  - the gradient reduce bucket (reduce_bucket_size elements);
  - no boundary activations: each layer's checkpointed input waits in host memory (cpu_checkpointing);
  - the larger of
      a layer's recompute + backward: its input copied back (T x h), the attention side of an HF layer's
      working set over all T tokens (HF_WS_H h + HF_WS_KV kv per token) and the MLP side over one
      TiledMLP tile (HF_WS_I I per token);
      the tiled loss: the final hidden states and their gradient (2 T x h) plus one tile's logits
      (tile x V x LOSS_BYTES_EXTRA: logits, log-softmax and its gradient in FP32, plus the logits in the
      compute dtype when that is not FP32).
Arithmetic over shapes only, with the constants memory.py measured for HF layers and HF's loss.
"""

from __future__ import annotations

from typing import Any

from .hardware import GIB, Hardware
from .memory import HF_WS_H, HF_WS_I, HF_WS_KV, LOSS_BYTES_EXTRA, Memory, zero3_memory
from .point import Point

LOSS_TILE_LOGIT_BYTES = 64 * 2**20  # the backend's default loss tile: 64 MiB of FP32 logits
LEAN_REDUCE_BUCKET = 1_000_000  # elements, the lean configuration's reduce_bucket_size


def default_loss_tile(vocab: int) -> int:
    """Tokens per loss tile when none is configured (baselines/alst.py's default)."""
    return max(1, LOSS_TILE_LOGIT_BYTES // (4 * vocab))


def zero3_alst_device_terms(model: Any, tokens: int, c: int = 4, *, mlp_tile: int | None = None,
                            loss_tile: int | None = None, reduce_bucket: int = LEAN_REDUCE_BUCKET) -> dict[str, int]:
    """Peak device bytes by term for `model` (a ModelPreset) at `tokens` per micro-batch.

    `mlp_tile` defaults to the hidden size (DeepSpeed's TiledMLP example), `loss_tile` to 64 MiB of FP32
    logits; both in tokens.
    """
    if tokens < 1 or c not in (2, 4):
        raise ValueError(f"tokens must be >= 1 and c 2 or 4, not tokens={tokens}, c={c}")
    h, kv, inter, vocab = model.hidden, model.kv_heads * model.head_dim, model.intermediate, model.vocab
    mlp_tile = min(tokens, mlp_tile or h)
    loss_tile = min(tokens, loss_tile or default_loss_tile(vocab))
    layer = tokens * h * c + int(tokens * (HF_WS_H * h + HF_WS_KV * kv) * c) + int(mlp_tile * HF_WS_I * inter * c)
    loss = 2 * tokens * h * c + loss_tile * vocab * (LOSS_BYTES_EXTRA + (c if c != 4 else 0))
    return {"fetched embedding/head": vocab * h * c, "grad reduce bucket": reduce_bucket * c,
            "working set (layer or loss)": max(layer, loss)}


def zero3_alst_peak_bytes(model: Any, tokens: int, c: int = 4, **kw: Any) -> int:
    return sum(zero3_alst_device_terms(model, tokens, c, **kw).values())


def zero3_alst_memory(p: Point, hw: Hardware) -> Memory:
    """The zero3-alst backend at a planner point: ZeRO-3 offload's host side (as `zero3`) plus every layer's
    checkpointed input in host memory (cpu_checkpointing); on the device the terms above with the backend's
    default tiles (the sweep's `zero3` overrides size the reduce bucket, else the lean 1M elements)."""
    base = zero3_memory(p, hw)
    m = p.model
    host = dict(base.host)
    host["offloaded checkpoints"] = m.num_layers * p.tokens * m.hidden * p.c
    bucket = p.zero3_reduce_bucket if p.zero3_reduce_bucket is not None else LEAN_REDUCE_BUCKET
    device = dict(zero3_alst_device_terms(m, p.tokens, p.c, reduce_bucket=bucket))
    device["runtime"] = 0 if hw.unified_memory else int(hw.device_reserved_gib * GIB)
    return Memory(host, device, hw.unified_memory)
