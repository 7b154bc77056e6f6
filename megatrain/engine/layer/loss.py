"""LM head + cross-entropy over token chunks: the full tokens x vocab logits never exist, forward or backward."""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ...models.adapter import LogitTransform
from ..runtime.host_copy import HostCopy, host_value, to_device

IGNORE_INDEX = -100
# Rows a tile sends through the head: its labeled tokens, rounded up to a multiple of this with unlabeled ones. A
# ragged row count slows the head's GEMMs (1022 rows ran 4.6% slower per GEMM than 1024 on a 2-core CPU, the
# shifted labels of 2 x 512 tokens); an unlabeled row gets a zero gradient row, so it adds nothing to any gradient.
HEAD_ROW_ALIGN = 64


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


# Device labels -> their copy in host memory, queued when the batch came in (batch.py, PendingCheck.sanitize). Which
# tokens count, how many, and each tile's rows through the head are decided on the host: read off device labels,
# each of those is a sync (a nonzero, a count), about four per tile. Keyed by the tensor's identity, weakly: an
# entry lives as long as the labels it copies.
_HOST_LABELS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def keep_host_labels(labels: torch.Tensor, host: HostCopy | torch.Tensor) -> None:
    """Hand the losses `host`, a copy of `labels` in host memory (to_host's, queued early enough to be done by the
    loss): given these `labels` they read that copy instead of the device. `host` must hold the same values."""
    if host is not labels:  # the labels themselves (host labels): nothing to keep, and no entry kept alive by itself
        _HOST_LABELS[labels] = host


def host_labels(labels: torch.Tensor) -> torch.Tensor:
    """`labels` in host memory: the copy kept for them (its queued copy waited for, not the device's queue), else
    `labels` themselves (device labels without a copy are then read on the device: a sync per read)."""
    host = _HOST_LABELS.get(labels)
    return labels if host is None else host_value(host)


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """HF's causal shift: position t predicts labels[t + 1]; the last position predicts nothing."""
    pad = torch.full_like(labels[:, :1], IGNORE_INDEX)
    return torch.cat([labels[:, 1:], pad], dim=1)


def head_rows(labeled: torch.Tensor, align: int | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Which of a tile's rows go through the head, from its host mask of labeled rows: (their indices, None for
    every row; the positions among them of the labeled ones). The labeled rows, rounded up to a multiple of
    `align` (default HEAD_ROW_ALIGN) or to the whole tile, with the first unlabeled rows."""
    align = align or HEAD_ROW_ALIGN
    rows = labeled.numel()
    keep = labeled.nonzero().squeeze(1)
    n = keep.numel()
    m = min(rows, -(-n // align) * align)
    if m == rows:
        return None, keep
    if m == n:
        return keep, torch.arange(n)
    taken = torch.cat([keep, (~labeled).nonzero().squeeze(1)[: m - n]])
    return taken, torch.arange(n)


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            softcap: LogitTransform | float | None) -> torch.Tensor:
    """One chunk's logits as the model's head computes them, in FP32 (HF upcasts logits before the loss).

    `h` is cast to the head's dtype first, as Mamba's head does: with bf16 compute a model whose last layer or
    final norm returns FP32 (a residual kept in FP32) would otherwise hand a bf16 head an FP32 input."""
    z = torch.nn.functional.linear(h.to(weight.dtype), weight, bias).float()
    return _apply(z, as_transform(softcap))


class TileBuffers:
    """A CPU device's loss-tile buffers (the logits, their gradient, the head's weight gradient), kept from step to
    step. On the host a fresh tensor past glibc's mmap threshold (32 MiB at most: a 1024-token tile at vocab 8192
    is that) is mapped afresh and page-faulted in on every allocation, each time; a CUDA device's caching
    allocator already reuses them, and holding them there would keep loss workspace outside the loss phase.
    Buffers over `cap_bytes` are not kept (their faults are small beside their GEMMs)."""

    def __init__(self, cap_bytes: int = 256 << 20) -> None:
        self.cap_bytes = cap_bytes
        self._held: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised `shape` tensor: the kept buffer `name` (grown to it if smaller), or a fresh one."""
        n = shape[0] * shape[1]
        if n * torch.empty((), dtype=dtype).element_size() > self.cap_bytes:
            return torch.empty(shape, dtype=dtype, device=device)
        b = self._held.get(name)
        if b is None or b.numel() < n or b.dtype != dtype or b.device != device:
            b = self._held[name] = torch.empty(n, dtype=dtype, device=device)
        return b[:n].view(shape)


def _tile_logits(hc: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 softcap: LogitTransform | float | None,
                 buffers: TileBuffers | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A tile's FP32 logits and an uninitialised FP32 buffer of their shape (for their gradient), from `buffers`
    where given: the logits themselves when the head is FP32 and they are not transformed (the GEMM writes into
    the kept buffer; the same bits as `_logits`)."""
    shape = (hc.shape[0], weight.shape[0])
    take = (lambda name: buffers.take(name, shape, torch.float32, hc.device)) if buffers is not None else None
    t = as_transform(softcap)
    if take is not None and weight.dtype == torch.float32 and t.scale is None and t.softcap is None:
        logits = take("logits")
        if bias is None:
            torch.mm(hc, weight.t(), out=logits)
        else:
            torch.addmm(bias, hc, weight.t(), out=logits)
    else:
        logits = _logits(hc, weight, bias, softcap)
    return logits, (take("logits_grad") if take is not None else torch.empty_like(logits))


def _add_head_grad(acc: torch.Tensor | None, p: torch.Tensor, hc: torch.Tensor,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """acc + p.T @ hc, the head weight's gradient summed over chunks in FP32; `acc` None (the first chunk): p.T @ hc
    itself (written into `out` if given), the bits of adding it to zeros (a -0 kept, as the head's own backward
    keeps it) without a vocab x hidden zero fill and the GEMM's read of it."""
    if hc.dtype == torch.float32:
        if acc is None:
            return torch.mm(p.t(), hc) if out is None else torch.mm(p.t(), hc, out=out)
        return acc.addmm_(p.t(), hc)  # in place: no second temporary
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
        # each token's loss in its place, summed once: the same bits whatever the chunk (a plan's choice)
        per_token = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        for s in range(0, h.shape[0], chunk):
            logits = _logits(h[s: s + chunk], weight, bias, softcap)
            t = targets[s: s + chunk]
            per_token[s: s + chunk] = torch.logsumexp(logits, dim=-1) - logits.gather(1, t[:, None]).squeeze(1)
        ctx.save_for_backward(h, weight, bias, targets)
        ctx.chunk, ctx.softcap = chunk, softcap
        return per_token.sum()

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
    worked out on the host: from host labels, or from the host copy kept for device labels (keep_host_labels; the
    engine keeps one for a device batch), so the device is never synchronised; device labels without one cost a
    sync (the number of valid tokens sizes the head's input).
    """
    targets = shift_labels(host_labels(labels).long()).reshape(-1)  # -100 must fit: check_batch admits uint8 ids
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
        if grad_out.device.type == "cpu" and grad_out.item() == 1.0:  # the usual loss.backward(): x * 1 is x
            return (None, None, *grads)
        return (None, None, *[g.mul_(grad_out.to(g.dtype)) for g in grads])  # in place: they are ours alone


def tiled_norm_head_loss(hidden: torch.Tensor, norm: torch.nn.Module, head: torch.nn.Linear, labels: torch.Tensor,
                         tile_tokens: int, num_items_in_batch: int | torch.Tensor | None = None,
                         softcap: LogitTransform | float | None = None,
                         buffers: TileBuffers | None = None) -> torch.Tensor:
    """`chunked_causal_lm_loss(norm(hidden), head, labels, ...)` with the final norm included, computed in
    sequence tiles of `tile_tokens` whose backward runs here, in the forward: per token only `hidden` and
    its gradient stay on the device (no normed copy, no norm graph over all tokens), per tile the norm's
    graph and the tile's logits. The head's weight gradient is accumulated in FP32 as the chunked loss does.

    `buffers`: where the tile's logits, their gradient and the head's weight gradient are kept from call to call
    (a CPU device's, TileBuffers); the head's gradient handed to autograd is then that buffer, valid until the next
    call.

    Each tile's rows, its count of labels and its targets are worked out on the host, from host labels or the
    host copy kept for device labels (keep_host_labels): no host sync with either (device labels without a copy
    cost a few per tile).

    Returns the loss; backpropagating it hands the gradients already computed (for `hidden`, the norm's
    and the head's parameters) to autograd, scaled by the incoming gradient: one backward per forward.
    """
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens must be >= 1, not {tile_tokens}")
    targets = shift_labels(host_labels(labels).long()).reshape(-1)
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
    per_token = torch.zeros(tokens, dtype=torch.float32, device=dev)  # summed once: the same bits whatever the tile
    for s in range(0, tokens, tile_tokens):
        x = (x_all[:, s: s + tile_tokens] if streams else x_all[s: s + tile_tokens]).detach().requires_grad_(True)
        with torch.enable_grad():
            hn = norm(x)
            hn = hn.reshape(-1, hn.shape[-1]) if streams else hn
        tile_valid = valid[s: s + tile_tokens]
        if hn.shape[0] != tile_valid.numel():
            raise ValueError(f"the module after the layers ({type(norm).__name__}) gave {hn.shape[0]} hidden vectors "
                             f"for {tile_valid.numel()} tokens; the head takes one per token (a model with several "
                             "residual streams per token must mix them into one before its head)")
        if not tile_valid.any():
            (grad_x[:, s: s + tile_tokens] if streams else grad_x[s: s + tile_tokens]).zero_()
            continue
        taken, labeled = head_rows(tile_valid)
        t = targets[s: s + tile_tokens] if taken is None else targets[s: s + tile_tokens].index_select(0, taken)
        unlabeled = (t == IGNORE_INDEX).nonzero().squeeze(1)
        t = to_device(t.clamp_min(0), dev)  # an unlabeled row's target: any class, its gradient row zeroed below
        hc = hn.detach() if taken is None else hn.detach().index_select(0, to_device(taken, dev))
        hc = hc.to(weight.dtype)
        with torch.no_grad():
            logits, p = _tile_logits(hc, weight, bias, softcap, buffers)
            # logsumexp as torch computes it, log(sum(exp(z - max))) + max (the same bits), its exp in the gradient's
            # buffer rather than a temporary of its own; then the softmax over it
            top = logits.amax(dim=-1, keepdim=True)
            lse = torch.sub(logits, top, out=p).exp_().sum(dim=-1, keepdim=True).log_().add_(top)
            per_row = (lse - logits.gather(1, t[:, None])).squeeze(1)
            rows = (torch.arange(s, s + tile_valid.numel()) if taken is None else taken + s)
            rows = rows if unlabeled.numel() == 0 else rows.index_select(0, labeled)
            per_token.index_copy_(0, to_device(rows, dev),
                                  per_row if unlabeled.numel() == 0 else per_row.index_select(0, to_device(labeled, dev)))
            torch.softmax(logits, dim=-1, out=p)
            p[torch.arange(p.shape[0], device=dev), t] -= 1.0
            if unlabeled.numel():
                p.index_fill_(0, to_device(unlabeled, dev), 0.0)
            p = _grad_to_head(p, logits, as_transform(softcap))
            del logits
            p = p.mul_(inv).to(hc.dtype)  # in place: no second tile x vocab buffer
            if taken is None:
                g_hn = (p @ weight).to(hn.dtype)  # every row went through the head: no scatter
            else:
                g_hn = torch.zeros_like(hn)
                g_hn.index_copy_(0, to_device(taken, dev), (p @ weight).to(g_hn.dtype))
            if weight.requires_grad:
                out = None if grad_w is not None or buffers is None or hc.dtype != torch.float32 else buffers.take(
                    "head_grad", tuple(weight.shape), torch.float32, weight.device)
                grad_w = _add_head_grad(grad_w, p, hc, out)
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
    return _PrecomputedGrads.apply(per_token.sum() * inv, grads, *inputs)
