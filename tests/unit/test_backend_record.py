"""The harness records which optimizer kernel and which settings each backend actually ran."""

from __future__ import annotations

import types

import pytest
import torch

from experiments.backend_record import backend_settings, describe_optimizer, innermost_optimizer


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(8))]


def test_kernel_of_a_torch_adamw_is_named():
    assert describe_optimizer(torch.optim.AdamW(_params(), fused=True)) == "torch.optim.AdamW(fused)"
    assert describe_optimizer(torch.optim.AdamW(_params(), foreach=True)) == "torch.optim.AdamW(foreach)"
    # the slow default on a CPU must not pass as a fast kernel
    assert describe_optimizer(torch.optim.AdamW(_params())) == "torch.optim.AdamW(default kernel)"


def test_wrappers_are_followed_to_the_optimizer_that_steps():
    inner = torch.optim.Adam(_params(), fused=True)
    zero = types.SimpleNamespace(optimizer=inner)        # like DeepSpeed's ZeRO optimizer
    wrapped = types.SimpleNamespace(optimizer=zero)      # like an AcceleratedOptimizer
    assert innermost_optimizer(wrapped) is inner
    assert describe_optimizer(wrapped) == "torch.optim.Adam(fused)"
    loop = types.SimpleNamespace()
    loop.optimizer = loop  # a self-reference ends the walk instead of looping forever
    assert innermost_optimizer(loop) is loop


def test_cpu_adam_mode_is_recorded():
    class DeepSpeedCPUAdam:  # stands in for deepspeed.ops.adam.DeepSpeedCPUAdam (needs a JIT build)
        adam_w_mode = True
    DeepSpeedCPUAdam.__module__ = "deepspeed.ops.adam.cpu_adam"
    assert describe_optimizer(DeepSpeedCPUAdam()) == "deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode)"


def test_settings_are_the_zero3_section_as_built():
    z = {"stage": 3, "stage3_prefetch_bucket_size": 123}
    plugin = types.SimpleNamespace(deepspeed_config={"zero_optimization": z})
    backend = types.SimpleNamespace(name="zero3", ds_config={"zero_optimization": {"stage": 3}},
                                    accelerate=types.SimpleNamespace(state=types.SimpleNamespace(deepspeed_plugin=plugin)))
    assert backend_settings(types.SimpleNamespace(backend=backend)) == {"zero_optimization": z}
    # before Accelerate built the engine, the backend's own config
    backend.accelerate = None
    assert backend_settings(types.SimpleNamespace(backend=backend)) == {"zero_optimization": {"stage": 3}}
    assert backend_settings(types.SimpleNamespace(backend=types.SimpleNamespace(name="torch"))) == {}


def test_fused_adamw_is_the_same_math_as_the_default_kernel():
    """The torch baseline switched kernels; its numbers must not move. Negative control: a
    different lr does move them, so the comparison can fail."""
    def train(lr: float, **kernel) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, **kernel)
        gen = torch.Generator().manual_seed(1)
        for _ in range(10):
            x = torch.randn(8, 16, generator=gen)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    ref = train(1e-3)
    fused = train(1e-3, fused=True)
    assert max((a - b).abs().max().item() for a, b in zip(ref, fused)) <= 1e-6
    other = train(1.1e-3, fused=True)
    assert max((a - b).abs().max().item() for a, b in zip(ref, other)) > 1e-5


@pytest.mark.parametrize("bad", [0, -5, 3.0, True, None])
def test_hidden_size_tuning_refuses_bad_sizes(bad):
    from baselines.zero3 import hidden_size_tuning

    with pytest.raises(ValueError, match="hidden_size must be a positive integer"):
        hidden_size_tuning(bad)
