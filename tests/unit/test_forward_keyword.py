"""A face serves a forward keyword of its own (TRL's `fused_lm_head=True`) from the bound model's class.

`serve_forward_keyword` lets the engine-run forward take a keyword without setting a forward on the model
instance: the call goes to the face's handler with the routed forward. Served so, TRL's fused head gives
through the face's own routine (backend/fused_head.py's serve_fused_lm_head) what a handler registered
here gives, bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_model

from megatrain.engine import Engine, serve_forward_keyword


def test_a_served_keyword_goes_to_its_handler_with_the_routed_forward():
    pytest.importorskip("trl")
    from megatrain.backend.fused_head import FusedHeadOptions, fused_lm_head_forward, serve_fused_lm_head

    options = FusedHeadOptions(temperature=0.7)
    ref = tiny_model("llama", layers=2)
    patched, served = copy.deepcopy(ref), copy.deepcopy(ref)
    patched_eng = Engine(patched)
    serve_fused_lm_head(patched, options, patched_eng.head_chunk_tokens)  # the face's routine
    eng = Engine(served)

    def fused_head(routed, input_ids=None, **kwargs):
        return fused_lm_head_forward(routed, input_ids, kwargs, options, chunk_tokens=eng.head_chunk_tokens)

    serve_forward_keyword(served, "fused_lm_head", fused_head)
    assert "forward" not in vars(served)
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(1))
    want, got = (m(input_ids=ids, labels=ids, fused_lm_head=True) for m in (patched, served))
    assert torch.equal(got.log_probs, want.log_probs) and torch.equal(got.loss, want.loss)
    patched_eng.backward(want.loss)
    eng.backward(got.loss)
    patched_eng.synchronize()  # the layers' gradients land on host threads
    eng.synchronize()
    for (n, a), (_, b) in zip(patched_eng.named_parameters(), eng.named_parameters()):
        assert torch.equal(a.grad, b.grad), n
    # Without the keyword (or with it False) the call is the plain route: the engine's loss
    plain = served(input_ids=ids, labels=ids, fused_lm_head=False)
    assert plain.logits is None and torch.equal(plain.loss, served(input_ids=ids, labels=ids).loss)
    assert not hasattr(plain, "log_probs") or plain.log_probs is None


def test_a_keyword_for_a_model_no_engine_serves_is_refused():
    with pytest.raises(ValueError, match="not served by a MegaTrain engine"):
        serve_forward_keyword(tiny_model("llama", layers=1), "fused_lm_head", lambda routed, **kw: None)
