"""Device memory of DeepSpeed ZeRO-3 offload with its ALST long-sequence pieces (the `zero3-alst` backend).

What that configuration keeps on the device at one micro-batch of T tokens (c = bytes of the compute
dtype), term by term as baselines/alst.py sets it up on top of the lean ZeRO-3 settings:
  - the gradient reduce bucket (reduce_bucket_size elements, at most the model's parameters), allocated
    when DeepSpeed initializes;
  - no boundary activations: each layer's checkpointed input waits in host memory (cpu_checkpointing);
  - the RoPE tables (cos, sin: 2 head_dim per token), computed once per forward;
  - the larger of
      a layer's recompute + backward (its peak is on the attention side; the MLP runs in TiledMLP tiles):
      ALST_LAYER_H h + 2 kv per token in the compute dtype and the attention's FP32 log-sum-exp (one value
      per head per token), next to the largest linear ZeRO-3 has fetched;
      the tiled loss: ALST_LOSS_H h per token (the final norm's input, output and gradients) plus one tile's
      logits (tile x V x LOSS_BYTES_EXTRA: logits, log-softmax and its gradient in FP32, plus the logits in
      the compute dtype when that is not FP32) and the embedding / head ZeRO-3 fetched for it (V x h).
The per-token constants are measured with DeviceMemoryTracker on two shapes (results/long_context/tiny-32mib,
small-7m-128mib: FP32, peaks exactly linear in T, 13.05 and 13.01 h beyond the kv, RoPE and log-sum-exp
terms); 9.3 h of them are an HF layer's working set under recompute (memory.py HF_WS_H), the rest the
checkpointed input copied back and DeepSpeed's checkpoint backward holding the input gradients it returns.
"""

from __future__ import annotations

from typing import Any

from .hardware import GIB, Hardware
from .memory import LOSS_BYTES_EXTRA, Memory, zero3_memory
from .point import Point

LOSS_TILE_LOGIT_BYTES = 64 * 2**20  # the backend's default loss tile: 64 MiB of FP32 logits
LEAN_REDUCE_BUCKET = 1_000_000  # elements, the lean configuration's reduce_bucket_size
ALST_LAYER_H, ALST_KV, ALST_ROPE_HD = 13.0, 2.0, 2.0
ALST_LOSS_H = 4.0
BUCKET_TERM = "grad reduce bucket"  # allocated at initialization, before any step


def default_loss_tile(vocab: int) -> int:
    """Tokens per loss tile when none is configured (baselines/alst.py's default)."""
    return max(1, LOSS_TILE_LOGIT_BYTES // (4 * vocab))


def zero3_alst_device_terms(model: Any, tokens: int, c: int = 4, *, mlp_tile: int | None = None,
                            loss_tile: int | None = None, reduce_bucket: int = LEAN_REDUCE_BUCKET) -> dict[str, int]:
    """Peak device bytes by term for `model` (a ModelPreset) at `tokens` per micro-batch.

    `loss_tile` defaults to 64 MiB of FP32 logits (in tokens); `mlp_tile` (default: the hidden size,
    DeepSpeed's TiledMLP example) is checked but sets no term: the MLP tile's working set is smaller than
    the attention side of the recompute it follows.
    """
    if tokens < 1 or c not in (2, 4):
        raise ValueError(f"tokens must be >= 1 and c 2 or 4, not tokens={tokens}, c={c}")
    if mlp_tile is not None and mlp_tile < 1:
        raise ValueError(f"mlp_tile must be >= 1 tokens, not {mlp_tile}")
    h, kv, inter, vocab = model.hidden, model.kv_heads * model.head_dim, model.mlp_width(), model.vocab
    loss_tile = min(tokens, loss_tile or default_loss_tile(vocab))
    layer = int(tokens * ((ALST_LAYER_H * h + ALST_KV * kv) * c + model.heads * 4)) + h * inter * c
    loss = int(tokens * ALST_LOSS_H * h * c) + loss_tile * vocab * (LOSS_BYTES_EXTRA + (c if c != 4 else 0)) \
        + vocab * h * c
    return {BUCKET_TERM: min(reduce_bucket, model.param_count()) * c,
            "rope tables": int(tokens * ALST_ROPE_HD * model.head_dim * c),
            "working set (layer or loss)": max(layer, loss)}


def zero3_alst_memory(p: Point, hw: Hardware) -> Memory:
    """The zero3-alst backend at a planner point: ZeRO-3 offload's host side (as `zero3`) plus every layer's
    checkpointed input in host memory (cpu_checkpointing); on the device the terms above with the backend's
    default tiles (the sweep's `zero3` overrides size the reduce bucket, else the lean 1M elements)."""
    base = zero3_memory(p, hw)
    m = p.model
    host = dict(base.host)
    host["offloaded checkpoints"] = m.num_layers * p.tokens * m.boundary_width * p.c
    bucket = p.zero3_reduce_bucket if p.zero3_reduce_bucket is not None else LEAN_REDUCE_BUCKET
    device = dict(zero3_alst_device_terms(m, p.tokens, p.c, reduce_bucket=bucket))
    device["runtime"] = 0 if hw.unified_memory else int(hw.device_reserved_gib * GIB)
    return Memory(host, device, hw.unified_memory)
