"""The layers' FP32 linears on a CPU device through oneDNN in the forward (engine/layer/cpu_linear.py): outputs
within FP32 rounding of F.linear, gradients with autograd's own bits, used by the engine's layer calls, and the
same training to PyTorch's tolerance."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import make_batches, tiny_model

from megatrain.config.schema import EngineConfig
from megatrain.engine import Engine
from megatrain.engine.layer import cpu_linear

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="this torch build has no oneDNN linear")


@pytest.mark.parametrize("bias", [False, True])
def test_values_within_rounding_and_gradients_with_autograds_bits(bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 300, 256, generator=g).requires_grad_(True)
    w = (torch.randn(384, 256, generator=g) * 0.05).requires_grad_(True)
    b = torch.randn(384, generator=g).requires_grad_(True) if bias else None
    gy = torch.randn(2, 300, 384, generator=g)
    params = [x, w] + ([b] if bias else [])
    want = F.linear(x, w, b)
    want_grads = torch.autograd.grad(want, params, gy)
    with cpu_linear.OneDnnLinears() as mode:
        got = F.linear(x, w, b)
    assert mode.calls == 1 and got.shape == want.shape
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-6
    got_grads = torch.autograd.grad(got, params, gy)
    assert torch.equal(got_grads[0], want_grads[0]) and torch.equal(got_grads[1], want_grads[1])
    assert got_grads[1].is_contiguous() == want_grads[1].is_contiguous()  # the slab's reduction takes it whole
    if bias:  # the bias's sum over tokens: rounding apart
        assert torch.allclose(got_grads[2], want_grads[2], rtol=1e-5, atol=1e-5)


def test_only_float32_cpu_linears_are_taken():
    x, w = torch.randn(4, 8), torch.randn(5, 8)
    with cpu_linear.OneDnnLinears() as mode:
        F.linear(x.bfloat16(), w.bfloat16())
        F.linear(x.double(), w.double())
        y = F.linear(x, w)
    assert mode.calls == 1 and y.shape == (4, 5)


def test_the_engine_runs_its_layers_linears_through_it_and_trains_as_pytorch():
    """3 layers x 7 linears per forward (and per recompute); 3 AdamW steps within PyTorch's parity tolerance. The
    control: an engine without it runs none, and trains the same to that tolerance."""
    ref = tiny_model("llama", layers=3, hidden=64)
    batches = make_batches(3, seq=24)
    runs = []
    for use in (True, False):
        eng = Engine(copy.deepcopy(ref), EngineConfig(device="cpu", compute_dtype="float32", parity_probe=False))
        if not use:
            eng.templates.linears = None
        losses = []
        for b in batches:
            loss = eng(**b).loss
            eng.backward(loss)
            eng.step()
            eng.zero_grad()
            losses.append(loss.item())
        runs.append((losses, eng.state_dict(), eng.templates.linears))
    (losses, sd, mode), (plain_losses, plain_sd, none) = runs
    assert none is None and mode is not None and mode.calls >= 3 * 7 * len(batches)
    assert max(abs(a - b) for a, b in zip(losses, plain_losses)) <= 1e-5
    assert max((sd[n] - plain_sd[n]).abs().max().item() for n in sd) <= 1e-5
