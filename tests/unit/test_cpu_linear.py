"""The layers' FP32 linears on a CPU device through oneDNN in the forward (engine/layer/cpu_linear.py): outputs
within FP32 rounding of F.linear, gradients with autograd's own bits (on any thread count: a launcher's
OMP_NUM_THREADS=1 too), used by every run of the engine's layers, F.linear where the build lacks it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import make_batches, tiny_model
from kit import train_steps

from megatrain.config.schema import EngineConfig
from megatrain.engine import Engine
from megatrain.engine.layer import cpu_linear


def test_this_build_has_it():
    """The CPU wheel this project pins ships oneDNN: the tests below exercise it, not the fallback."""
    assert cpu_linear.available()


@pytest.mark.parametrize("threads", [None, 1])
@pytest.mark.parametrize("bias", [False, True])
def test_values_within_rounding_and_gradients_with_autograds_bits(bias, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2, 300, 256, generator=g).requires_grad_(True)
        w = (torch.randn(384, 256, generator=g) * 0.05).requires_grad_(True)
        b = torch.randn(384, generator=g).requires_grad_(True) if bias else None
        gy = torch.randn(2, 300, 384, generator=g)
        params = [x, w] + ([b] if bias else [])
        want = F.linear(x, w, b)
        want_grads = torch.autograd.grad(want, params, gy)
        with cpu_linear.OneDnnLinears() as mode:
            got = F.linear(input=x, weight=w, bias=b)  # by keyword too
        got_grads = torch.autograd.grad(got, params, gy)
    finally:
        torch.set_num_threads(before)
    assert mode.calls == 1 and got.shape == want.shape
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-6
    assert torch.equal(got_grads[0], want_grads[0]) and torch.equal(got_grads[1], want_grads[1])
    assert got_grads[1].is_contiguous() == want_grads[1].is_contiguous()  # the slab's reduction takes it whole
    if bias:  # the bias's sum over tokens: rounding apart
        assert torch.allclose(got_grads[2], want_grads[2], rtol=1e-5, atol=1e-5)


def test_a_model_may_write_into_its_output_in_place():
    """Llama 4's MoE scales its router's output in place: autograd refuses that on a custom Function's view
    output, so the output is a tensor of its own (sharing the GEMM's storage: no copy), and the gradients are
    F.linear's own through the same in-place op."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 16, generator=g).requires_grad_(True)
    w = torch.randn(8, 16, generator=g).requires_grad_(True)
    gy = torch.randn(2, 5, 8, generator=g)

    def run(y):
        y.mul_(2.0)
        return torch.autograd.grad(y, [x, w], gy)

    want = run(F.linear(x, w))
    with cpu_linear.OneDnnLinears() as mode:
        y = F.linear(x, w)
    assert mode.calls == 1 and y._base is None and y.is_contiguous() and y.shape == (2, 5, 8)
    got = run(y)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_only_float32_cpu_linears_are_taken():
    x, w = torch.randn(4, 8), torch.randn(5, 8)
    with cpu_linear.OneDnnLinears() as mode:
        F.linear(x.bfloat16(), w.bfloat16())
        F.linear(x.double(), w.double())
        y = F.linear(x, w)
    assert mode.calls == 1 and y.shape == (4, 5)


def test_a_build_without_it_or_a_kernel_that_disagrees_is_not_used(monkeypatch):
    probe = cpu_linear.available.__wrapped__  # the uncached check

    def missing(*a):
        raise RuntimeError("no such op")

    monkeypatch.setattr(cpu_linear, "_onednn", missing)
    assert probe() is False
    monkeypatch.setattr(cpu_linear, "_onednn", lambda x, w, b: F.linear(x, w, b) * (1 + 1e-4))
    assert probe() is False
    monkeypatch.setattr(cpu_linear, "_onednn", lambda x, w, b: F.linear(x, w, b))
    assert probe() is True  # the control
    monkeypatch.setattr(cpu_linear, "available", lambda: False)
    eng = Engine(tiny_model("llama", layers=2), EngineConfig(device="cpu", parity_probe=False))
    assert eng.templates.linears is None


def _train(config: dict, use: bool, batches: list[dict]):
    eng = Engine(copy.deepcopy(tiny_model("llama", layers=3, hidden=64)),
                 EngineConfig(device="cpu", parity_probe=False, **config))
    if not use:
        eng.templates.linears = None
    losses, _ = train_steps(eng, batches, len(batches))
    return losses, eng.state_dict(), eng.templates.linears


@pytest.mark.parametrize("config", [pytest.param({}, id="kept"),
                                    pytest.param({"residency": "stream", "mlp_tile_tokens": 8}, id="stream-tiled")])
def test_every_run_of_the_engines_layers_goes_through_it_and_trains_as_pytorch(config):
    """Forward, recompute and the MLP-tiled backward alike (so a recompute has its forward's bits); 3 AdamW steps
    within PyTorch's parity tolerance of an engine without it (the control, which runs none)."""
    batches = make_batches(3, seq=24)
    (losses, sd, mode), (plain_losses, plain_sd, none) = (_train(config, use, batches) for use in (True, False))
    assert none is None and mode is not None
    per_pass = 3 * 7 * len(batches)  # layers x linears x forwards
    assert mode.calls >= (2 if config else 1) * per_pass  # the streamed layers' recompute runs them again
    assert max(abs(a - b) for a, b in zip(losses, plain_losses)) <= 1e-5
    assert max((sd[n] - plain_sd[n]).abs().max().item() for n in sd) <= 1e-5


def test_the_tiled_backward_recomputes_through_it_too():
    """A streamed layer whose MLP is tiled recomputes in its tiled backward (tiling.tiled_vjp): its linears there
    go through the same kernel as its forward's."""
    eng = Engine(tiny_model("llama", layers=2, hidden=64),
                 EngineConfig(device="cpu", parity_probe=False, residency="stream", mlp_tile_tokens=8))
    loss = eng(**make_batches(1, seq=24)[0]).loss
    forward = eng.templates.linears.calls
    eng.backward(loss)
    assert forward >= 2 * 7 and eng.templates.linears.calls - forward >= 2 * 7
    assert eng.pipeline.plan_stats()["mlp_tile_tokens"] == 8
