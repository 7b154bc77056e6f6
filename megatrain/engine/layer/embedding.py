"""The input embedding's weight gradient, without a dense vocab x hidden tensor and without assuming the lookup.

Models do more than `weight[ids]` in their embedding module: Gemma's multiplies by sqrt(hidden), others
normalize rows. Forward runs the module as it is; backward re-runs the same module over only the rows the
batch used (a shallow copy whose weight is those rows, indexed by their position), so autograd differentiates
whatever the module computes, and the gradient is scattered into the host slab by row.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..runtime.host_copy import to_device


def check_embedding(embed: nn.Embedding) -> None:
    """Refuse lookups whose gradient cannot be taken row by row."""
    kind = type(embed).__name__
    if embed.max_norm is not None:
        raise ValueError(f"{kind} renormalizes its weight in place (max_norm={embed.max_norm}); MegaTrain cannot "
                         "replay that on the host store")
    extra = [n for n, _ in embed.named_parameters() if n != "weight"]
    if extra:
        raise ValueError(f"{kind} has parameters besides its weight ({extra}); MegaTrain supports an embedding "
                         "whose only parameter is the table")


def lookup_grad(embed: nn.Embedding, ids: torch.Tensor, grad_out: torch.Tensor,
                host: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, gradient of those rows) of `embed(ids)` given d(loss)/d(output); the padding row gets none.

    `ids` in host memory while the table is on a device (the batch as the caller gave it): the rows are found on
    the host and returned there, and the device only gathers. torch.unique or a boolean mask on device ids would
    make the host wait for the device (the size of their output is data), once per micro-batch. `host`: take
    that path (True) or not (False) whatever the devices."""
    dev = embed.weight.device
    host_ids = ids if (ids.device != dev if host is None else host) else None
    if host_ids is not None:
        host_rows, host_index = torch.unique(host_ids.long(), return_inverse=True)
        rows, index = to_device(host_rows, dev), to_device(host_index, dev)
    else:
        rows, index = torch.unique(ids, return_inverse=True)
    grad = _rows_grad(embed, rows, index, grad_out)
    if host_ids is not None:
        if embed.padding_idx is None:
            return host_rows, grad
        keep = (host_rows != embed.padding_idx).nonzero().squeeze(1)
        return host_rows.index_select(0, keep), grad.index_select(0, to_device(keep, dev))
    if embed.padding_idx is not None:
        keep = rows != embed.padding_idx
        rows, grad = rows[keep], grad[keep]
    return rows, grad


def _rows_grad(embed: nn.Embedding, rows: torch.Tensor, index: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """d(loss)/d(table rows `rows`) of the module's lookup of `index` (positions in `rows`), the padding row included.
    A plain nn.Embedding's is its own backward called directly (what autograd runs for it: the same bits) without
    gathering the rows, which it never reads; any other module is re-run over the rows and differentiated."""
    if type(embed) is nn.Embedding and not embed.sparse:
        grad = torch.ops.aten.embedding_backward(grad_out, index, rows.numel(), -1, embed.scale_grad_by_freq, False)
        return grad.to(embed.weight.dtype)
    used = embed.weight.detach().index_select(0, rows).requires_grad_(True)
    view = copy.copy(embed)  # own parameter dict: the user's module is not touched, even for a moment
    view._parameters = {"weight": used}
    view.padding_idx = None  # the padding row is dropped by the caller, by its real index
    with torch.enable_grad():
        (grad,) = torch.autograd.grad(view(index), used, grad_out)
    return grad
