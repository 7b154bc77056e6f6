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


def lookup_grad(embed: nn.Embedding, ids: torch.Tensor, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, gradient of those rows) of `embed(ids)` given d(loss)/d(output); the padding row gets none."""
    rows, index = torch.unique(ids, return_inverse=True)
    used = embed.weight.detach().index_select(0, rows).requires_grad_(True)
    view = copy.copy(embed)  # own parameter dict: the user's module is not touched, even for a moment
    view._parameters = {"weight": used}
    view.padding_idx = None  # the padding row is dropped below, by its real index
    with torch.enable_grad():
        (grad,) = torch.autograd.grad(view(index), used, grad_out)
    if embed.padding_idx is not None:
        keep = rows != embed.padding_idx
        rows, grad = rows[keep], grad[keep]
    return rows, grad
