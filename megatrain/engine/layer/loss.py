"""LM head + cross-entropy over token chunks: the full tokens x vocab logits never exist, forward or backward."""

from __future__ import annotations

import torch

from ...models.adapter import LogitTransform
from ..runtime.host_copy import to_device

IGNORE_INDEX = -100


def as_transform(t: LogitTransform | float | None) -> LogitTransform:
    """A bare number is a softcap (the loss functions' `softcap` argument takes either)."""
    return t if isinstance(t, LogitTransform) else LogitTransform(softcap=t)


def _apply(z: torch.Tensor, t: LogitTransform) -> torch.Tensor:
    if t.scale is not None:
        z = z * t.scale
    return z if t.softcap is None else torch.tanh(z / t.softcap) * t.softcap


def _grad_to_head(p: torch.Tensor, logits: torch.Tensor, t: LogitTransform) -> torch.Tensor:
    """The gradient `p` with respect to the transformed logits, taken back to the head's output (in place)."""
    if t.softcap is not None:
        p *= 1.0 - (logits / t.softcap).square()  # d(c*tanh(z/c))/dz = 1 - tanh(z/c)^2
    if t.scale is not None:
        p *= t.scale
    return p


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """HF's causal shift: position t predicts labels[t + 1]; the last position predicts nothing."""
    pad = torch.full_like(labels[:, :1], IGNORE_INDEX)
    return torch.cat([labels[:, 1:], pad], dim=1)


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            softcap: LogitTransform | float | None) -> torch.Tensor:
    """One chunk's logits as the model's head computes them, in FP32 (HF upcasts logits before the loss).

    `h` is cast to the head's dtype first, as Mamba's head does: with bf16 compute a model whose last layer or
    final norm returns FP32 (a residual kept in FP32) would otherwise hand a bf16 head an FP32 input."""
    z = torch.nn.functional.linear(h.to(weight.dtype), weight, bias).float()
    return _apply(z, as_transform(softcap))


def _add_head_grad(acc: torch.Tensor | None, p: torch.Tensor, hc: torch.Tensor) -> torch.Tensor:
    """acc + p.T @ hc, the head weight's gradient summed over chunks in FP32; `acc` None (the first chunk): p.T @ hc
    itself, the bits of adding it to zeros (a -0 kept, as the head's own backward keeps it) without a vocab x hidden
    zero fill and the GEMM's read of it."""
    if hc.dtype == torch.float32:
        return torch.mm(p.t(), hc) if acc is None else acc.addmm_(p.t(), hc)  # in place: no second temporary
    g = (p.t() @ hc).float()
    return g if acc is None else acc.add_(g)


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
        grad_w = None  # the first chunk's gradient, then the sum (_add_head_grad)
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if ctx.needs_input_grad[2] else None
        for s in range(0, h.shape[0], chunk):
            hc = h[s: s + chunk].to(weight.dtype)
            logits = _logits(hc, weight, bias, softcap)
            p = torch.softmax(logits, dim=-1)
            p[torch.arange(p.shape[0], device=p.device), targets[s: s + chunk]] -= 1.0
            p = _grad_to_head(p, logits, as_transform(softcap))
            p = p.mul_(grad_out).to(weight.dtype)  # in place: no second chunk x vocab buffer
            if grad_h is not None:
                grad_h[s: s + chunk] = p @ weight
            if ctx.needs_input_grad[1]:
                grad_w = _add_head_grad(grad_w, p, hc)
            if grad_b is not None:
                grad_b += p.sum(0, dtype=torch.float32)
        if ctx.needs_input_grad[1] and grad_w is None:  # no tokens
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        return (grad_h, (grad_w.to(weight.dtype) if grad_w is not None else None),
                (grad_b.to(bias.dtype) if grad_b is not None else None), None, None, None)


def chunked_causal_lm_loss(hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor, chunk_tokens: int,
                           num_items_in_batch: int | torch.Tensor | None = None,
                           softcap: LogitTransform | float | None = None) -> torch.Tensor:
    """Cross-entropy over valid (!= -100) shifted labels, as HF's ForCausalLMLoss computes it: the mean,
    or with `num_items_in_batch` the sum divided by it (transformers' gradient-accumulation fix). The
    logits are `head(hidden)` (its bias included), soft-capped as `softcap * tanh(logits / softcap)` when
    the model does that (Gemma 2); `softcap` may be a LogitTransform, which scales them first (Cohere, Granite).

    Only tokens with a label go through the head: padding costs no head FLOPs. Which tokens those are is
    worked out where `labels` live: given host labels (the usual case) the device is never synchronised;
    labels already on the device cost one sync (the number of valid tokens sizes the head's input).
    """
    targets = shift_labels(labels.long()).reshape(-1)  # -100 must fit: check_batch admits uint8 ids
    valid = (targets != IGNORE_INDEX).nonzero().squeeze(1)
    n_valid = valid.numel()
    dev = hidden.device
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, to_device(valid, dev))
    total = _ChunkedHeadLoss.apply(h, head.weight, head.bias, to_device(targets.index_select(0, valid), dev),
                                   chunk_tokens, softcap)
    if num_items_in_batch is None:
        return total / n_valid
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def head_logits(hidden: torch.Tensor, head: torch.nn.Linear, logits_to_keep: int | torch.Tensor = 0,
                softcap: LogitTransform | float | None = None) -> torch.Tensor:
    """The full logits `[batch, seq, vocab]` (or the positions `logits_to_keep` selects, as HF's forward
    does), for callers that use them; they cost batch x seq x vocab x 4 bytes (FP32) plus as much again
    for their gradient when a loss is computed from them."""
    keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    return _apply(head(hidden[:, keep, :].to(head.weight.dtype)), as_transform(softcap))


def logits_tokens(ids: torch.Tensor, logits_to_keep: int | torch.Tensor = 0) -> int:
    """How many positions' logits head_logits hands back for a batch of token ids `ids` ([batch, seq])."""
    rows, seq = (1, ids.shape[0]) if ids.dim() == 1 else (ids.numel() // ids.shape[-1], ids.shape[-1])
    if torch.is_tensor(logits_to_keep):
        kept = logits_to_keep.numel() if logits_to_keep.dtype != torch.bool else int(logits_to_keep.sum())
    else:
        kept = seq if logits_to_keep == 0 else min(int(logits_to_keep), seq)
    return rows * kept


class _PrecomputedGrads(torch.autograd.Function):
    """A loss whose backward was already run: returns the gradients computed in the forward, scaled by the
    incoming gradient. They are handed over once and then released (a second backward is refused), so
    the hidden-state gradient and the head's gradient do not outlive the backward that consumes them."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, grads: list, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.grads = grads
        return value.clone()

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            raise RuntimeError("this loss was computed with its backward inside the forward and has been "
                               "backpropagated once already; run a new forward for another backward")
        return (None, None, *[g.mul_(grad_out.to(g.dtype)) for g in grads])  # in place: they are ours alone


def tiled_norm_head_loss(hidden: torch.Tensor, norm: torch.nn.Module, head: torch.nn.Linear, labels: torch.Tensor,
                         tile_tokens: int, num_items_in_batch: int | torch.Tensor | None = None,
                         softcap: LogitTransform | float | None = None) -> torch.Tensor:
    """`chunked_causal_lm_loss(norm(hidden), head, labels, ...)` with the final norm included, computed in
    sequence tiles of `tile_tokens` whose backward runs here, in the forward: per token only `hidden` and
    its gradient stay on the device (no normed copy, no norm graph over all tokens), per tile the norm's
    graph and the tile's logits. The head's weight gradient is accumulated in FP32 as the chunked loss does.

    Returns the loss; backpropagating it hands the gradients already computed (for `hidden`, the norm's
    and the head's parameters) to autograd, scaled by the incoming gradient: one backward per forward.
    """
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens must be >= 1, not {tile_tokens}")
    targets = shift_labels(labels.long()).reshape(-1)
    valid = targets != IGNORE_INDEX
    n_valid = int(valid.sum())
    dev, width = hidden.device, hidden.shape[-1]
    if num_items_in_batch is None:
        denom: float | torch.Tensor = float(n_valid)
    elif torch.is_tensor(num_items_in_batch):
        denom = num_items_in_batch.to(dev, torch.float32)
    else:
        denom = float(num_items_in_batch)
    inv = 1.0 / denom
    # Several residual streams per token (DeepSeek-V4's hyper-connections: batch x seq x streams x hidden): the
    # module after the layers reads the stream dims per token, so tiles keep them, under a batch dim of 1.
    streams = hidden.dim() > 3
    x_all = hidden.detach().reshape(1, -1, *hidden.shape[2:]) if streams else hidden.detach().reshape(-1, width)
    tokens = x_all.shape[1] if streams else x_all.shape[0]
    weight, bias = head.weight, head.bias
    norm_params = [p for p in norm.parameters() if p.requires_grad]
    grad_x = torch.empty_like(x_all)
    grad_norm = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in norm_params]
    grad_w = None  # the first tile's gradient, then the sum (_add_head_grad)
    grad_b = (torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
              if bias is not None and bias.requires_grad else None)
    total = torch.zeros((), dtype=torch.float32, device=dev)
    for s in range(0, tokens, tile_tokens):
        x = (x_all[:, s: s + tile_tokens] if streams else x_all[s: s + tile_tokens]).detach().requires_grad_(True)
        keep = valid[s: s + tile_tokens].nonzero().squeeze(1)
        with torch.enable_grad():
            hn = norm(x)
            hn = hn.reshape(-1, hn.shape[-1]) if streams else hn
        if keep.numel() == 0:
            (grad_x[:, s: s + tile_tokens] if streams else grad_x[s: s + tile_tokens]).zero_()
            continue
        idx = to_device(keep, dev)
        t = to_device(targets[s: s + tile_tokens].index_select(0, keep), dev)
        hc = hn.detach().index_select(0, idx).to(weight.dtype)
        with torch.no_grad():
            logits = _logits(hc, weight, bias, softcap)
            total += (torch.logsumexp(logits, dim=-1) - logits.gather(1, t[:, None]).squeeze(1)).sum()
            p = torch.softmax(logits, dim=-1)
            p[torch.arange(p.shape[0], device=dev), t] -= 1.0
            p = _grad_to_head(p, logits, as_transform(softcap))
            del logits
            p = p.mul_(inv).to(hc.dtype)  # in place: no second tile x vocab buffer
            g_hn = torch.zeros_like(hn)
            g_hn.index_copy_(0, idx, (p @ weight).to(g_hn.dtype))
            if weight.requires_grad:
                grad_w = _add_head_grad(grad_w, p, hc)
            if grad_b is not None:
                grad_b += p.sum(0, dtype=torch.float32)
            del p, hc
        gx, *gn = torch.autograd.grad(hn, [x, *norm_params], g_hn)
        del hn, g_hn
        if streams:
            grad_x[:, s: s + tile_tokens] = gx
        else:
            grad_x[s: s + tile_tokens] = gx
        for acc, g in zip(grad_norm, gn):
            acc += g.float()
    grads = [grad_x.view_as(hidden)] + [g.to(p.dtype) for g, p in zip(grad_norm, norm_params)]
    inputs = [hidden, *norm_params]
    if weight.requires_grad and grad_w is None:  # no tile had a label
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    if grad_w is not None:
        grads.append(grad_w.to(weight.dtype))
        inputs.append(weight)
    if grad_b is not None:
        grads.append(grad_b.to(bias.dtype))
        inputs.append(bias)
    return _PrecomputedGrads.apply(total * inv, grads, *inputs)
