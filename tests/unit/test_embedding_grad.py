"""The embedding's row gradient (engine/layer/embedding.py lookup_grad): a plain nn.Embedding's is its own backward
called directly, the bits autograd gives re-running the module over the rows, without gathering those rows."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megatrain.engine.layer.embedding import lookup_grad


class _Subclass(nn.Embedding):
    """The same lookup under another type: lookup_grad re-runs and differentiates it (the generic path)."""


class _Gathers(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket.__name__ in ("index_select", "embedding")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("padding_idx,scale", [(None, False), (3, False), (None, True)])
def test_a_plain_embeddings_row_gradient_is_its_own_backwards_bits(padding_idx, scale):
    torch.manual_seed(0)
    plain = nn.Embedding(50, 16, padding_idx=padding_idx, scale_grad_by_freq=scale)
    other = _Subclass(50, 16, padding_idx=padding_idx, scale_grad_by_freq=scale)
    other.load_state_dict(plain.state_dict())
    ids = torch.randint(0, 50, (3, 40))
    ids[0, :4] = 3
    g = torch.randn(3, 40, 16)
    with _Gathers() as direct:
        rows, grad = lookup_grad(plain, ids, g)
    with _Gathers() as rerun:
        want_rows, want = lookup_grad(other, ids, g)
    assert torch.equal(rows, want_rows) and torch.equal(grad.view(torch.int32), want.view(torch.int32))
    assert direct.count == 0 and rerun.count >= 2  # the control re-gathers the rows and looks them up
