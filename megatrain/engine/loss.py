"""LM head + cross-entropy over token chunks: the full tokens x vocab logits never exist, forward or backward."""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """HF's causal shift: position t predicts labels[t + 1]; the last position predicts nothing."""
    pad = torch.full_like(labels[:, :1], IGNORE_INDEX)
    return torch.cat([labels[:, 1:], pad], dim=1)


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, softcap: float | None) -> torch.Tensor:
    """One chunk's logits as the model's head computes them, in FP32 (HF upcasts logits before the loss)."""
    z = torch.nn.functional.linear(h, weight, bias).float()
    return z if softcap is None else torch.tanh(z / softcap) * softcap


class _ChunkedHeadLoss(torch.autograd.Function):
    """Sum of token cross-entropies of `softcap(h @ weight.T + bias)` against `targets` (all valid), chunk by
    chunk.

    Backward recomputes each chunk's logits instead of saving them, so the workspace is chunk x vocab.
    """

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                chunk: int, softcap: float | None) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for s in range(0, h.shape[0], chunk):
            logits = _logits(h[s: s + chunk], weight, bias, softcap)
            t = targets[s: s + chunk]
            total += (torch.logsumexp(logits, dim=-1) - logits.gather(1, t[:, None]).squeeze(1)).sum()
        ctx.save_for_backward(h, weight, bias, targets)
        ctx.chunk, ctx.softcap = chunk, softcap
        return total

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        h, weight, bias, targets = ctx.saved_tensors
        chunk, softcap = ctx.chunk, ctx.softcap
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if ctx.needs_input_grad[2] else None
        for s in range(0, h.shape[0], chunk):
            hc = h[s: s + chunk]
            logits = _logits(hc, weight, bias, softcap)
            p = torch.softmax(logits, dim=-1)
            p[torch.arange(p.shape[0], device=p.device), targets[s: s + chunk]] -= 1.0
            if softcap is not None:
                p *= 1.0 - (logits / softcap).square()  # d(c*tanh(z/c))/dz = 1 - tanh(z/c)^2
            p = (p * grad_out).to(h.dtype)
            if grad_h is not None:
                grad_h[s: s + chunk] = p @ weight
            if grad_w is not None and hc.dtype == torch.float32:
                grad_w.addmm_(p.t(), hc)  # in place: no second vocab x hidden temporary per chunk
            elif grad_w is not None:
                grad_w += (p.t() @ hc).float()
            if grad_b is not None:
                grad_b += p.sum(0, dtype=torch.float32)
        return (grad_h, (grad_w.to(weight.dtype) if grad_w is not None else None),
                (grad_b.to(bias.dtype) if grad_b is not None else None), None, None, None)


def chunked_causal_lm_loss(hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor, chunk_tokens: int,
                           num_items_in_batch: int | torch.Tensor | None = None,
                           softcap: float | None = None) -> torch.Tensor:
    """Cross-entropy over valid (!= -100) shifted labels, as HF's ForCausalLMLoss computes it: the mean,
    or with `num_items_in_batch` the sum divided by it (transformers' gradient-accumulation fix). The
    logits are `head(hidden)` (its bias included), soft-capped as `softcap * tanh(logits / softcap)` when
    the model does that (Gemma 2).

    Only tokens with a label go through the head: padding costs no head FLOPs. Which tokens those are is
    worked out where `labels` live: given host labels (the usual case) the device is never synchronised;
    labels already on the device cost one sync (the number of valid tokens sizes the head's input).
    """
    targets = shift_labels(labels.long()).reshape(-1)  # -100 must fit: check_batch admits uint8 ids
    valid = (targets != IGNORE_INDEX).nonzero().squeeze(1)
    n_valid = valid.numel()
    dev = hidden.device
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, valid.to(dev, non_blocking=True))
    total = _ChunkedHeadLoss.apply(h, head.weight, head.bias, targets.index_select(0, valid).to(dev, non_blocking=True),
                                   chunk_tokens, softcap)
    if num_items_in_batch is None:
        return total / n_valid
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def head_logits(hidden: torch.Tensor, head: torch.nn.Linear, logits_to_keep: int | torch.Tensor = 0,
                softcap: float | None = None) -> torch.Tensor:
    """The full logits `[batch, seq, vocab]` (or the positions `logits_to_keep` selects, as HF's forward
    does), for callers that use them; they cost batch x seq x vocab x 4 bytes (FP32) plus as much again
    for their gradient when a loss is computed from them."""
    keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    logits = head(hidden[:, keep, :])
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap
