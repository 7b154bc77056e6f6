"""LM head + cross-entropy over token chunks: the full tokens x vocab logits never exist, forward or backward."""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """HF's causal shift: position t predicts labels[t + 1]; the last position predicts nothing."""
    pad = torch.full_like(labels[:, :1], IGNORE_INDEX)
    return torch.cat([labels[:, 1:], pad], dim=1)


class _ChunkedHeadLoss(torch.autograd.Function):
    """Sum of token cross-entropies of `h @ weight.T` against `targets` (all valid), chunk by chunk.

    Backward recomputes each chunk's logits instead of saving them, so the workspace is chunk x vocab.
    """

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for s in range(0, h.shape[0], chunk):
            logits = (h[s: s + chunk] @ weight.t()).float()  # HF upcasts logits before the loss
            t = targets[s: s + chunk]
            total += (torch.logsumexp(logits, dim=-1) - logits.gather(1, t[:, None]).squeeze(1)).sum()
        ctx.save_for_backward(h, weight, targets)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        h, weight, targets = ctx.saved_tensors
        chunk = ctx.chunk
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        for s in range(0, h.shape[0], chunk):
            hc = h[s: s + chunk]
            logits = (hc @ weight.t()).float()
            p = torch.softmax(logits, dim=-1)
            p[torch.arange(p.shape[0], device=p.device), targets[s: s + chunk]] -= 1.0
            p = (p * grad_out).to(h.dtype)
            if grad_h is not None:
                grad_h[s: s + chunk] = p @ weight
            if grad_w is not None and hc.dtype == torch.float32:
                grad_w.addmm_(p.t(), hc)  # in place: no second vocab x hidden temporary per chunk
            elif grad_w is not None:
                grad_w += (p.t() @ hc).float()
        return grad_h, (grad_w.to(weight.dtype) if grad_w is not None else None), None, None


def chunked_causal_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                           chunk_tokens: int) -> torch.Tensor:
    """Mean cross-entropy over valid (!= -100) shifted labels, as HF's ForCausalLMLoss computes it.

    Only tokens with a label go through the head: padding costs no head FLOPs. Which tokens those are is
    worked out where `labels` live: given host labels (the usual case) the device is never synchronised;
    labels already on the device cost one sync (the number of valid tokens sizes the head's input).
    """
    targets = shift_labels(labels.long()).reshape(-1)  # -100 must fit: check_batch admits uint8 ids
    valid = (targets != IGNORE_INDEX).nonzero().squeeze(1)
    n_valid = valid.numel()
    dev = hidden.device
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, valid.to(dev, non_blocking=True))
    total = _ChunkedHeadLoss.apply(h, weight, targets.index_select(0, valid).to(dev, non_blocking=True), chunk_tokens)
    return total / n_valid
