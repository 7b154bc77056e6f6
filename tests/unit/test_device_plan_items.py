"""The device plan's items the review found missing or short (costs/memory.py, costs/residency.py), each against a
measurement: the logits handed back to a caller's HF/TRL loss (12-16 B per token x vocab, not 6), the device
optimizer's FP32 work buffer beside bf16 gradient slabs, and hyper-connection boundary activations times the
model's residual streams."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_model
from test_long_context_streams import small_v4_layer_input
from transformers.loss.loss_utils import ForCausalLMLoss

from megatrain.config.schema import EngineConfig
from megatrain.costs import memory as M
from megatrain.costs import residency as R
from megatrain.engine import Engine
from megatrain.engine.runtime.memtrack import DeviceMemoryTracker
from megatrain.engine.update import resident


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_callers_logits_budget_is_what_hfs_loss_holds(dtype):
    tokens, vocab = 512, 4096
    tracker = DeviceMemoryTracker(torch.device("cpu"))
    labels = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))
    with tracker.track():
        logits = torch.randn(1, tokens, vocab, dtype=dtype).requires_grad_(True)
        ForCausalLMLoss(logits, labels, vocab).backward()
    measured = tracker.tracked_peak
    planned = M.logits_workspace_bytes(tokens, vocab, torch.empty(0, dtype=dtype).element_size())
    assert abs(planned / measured - 1) <= 0.02, (planned / (tokens * vocab), measured / (tokens * vocab))
    assert 12 <= planned / (tokens * vocab) <= 16
    # the old budget (compute dtype + one FP32 copy: 6 B on bf16 logits) was less than half of it
    assert tokens * vocab * (logits.element_size() + 4) < 0.7 * measured


def test_bf16_gradient_slabs_add_the_device_updates_fp32_work_buffer():
    """What the device update allocates for an optimizer-resident layer (resident.move to a device: here the CPU,
    relocated as a GPU would be), per parameter, with Adam's m and v: 16 B with FP32 slabs, 18 with bf16 ones."""
    cfg = {"device": "cpu", "compute_dtype": "bfloat16", "host_master": "fp32", "parity_probe": False}
    for grad_dtype, itemsize in (("float32", 4), ("bfloat16", 2)):
        eng = Engine(tiny_model("llama", layers=2), EngineConfig(**cfg, host_grad_dtype=grad_dtype))
        group = eng.store.layers[0]
        resident.move(group, torch.device("cpu"), relocate=True)
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in (group.master, group.grad, group.grad_work)}
        measured = sum(storages.values()) / group.numel + 8  # Adam's m and v: FP32, one each per parameter
        assert measured == R.optimizer_bytes_per_param(itemsize), (grad_dtype, measured)
    assert R.optimizer_bytes_per_param(4) == R.OPTIMIZER_BYTES_PER_PARAM == 16
    with pytest.raises(ValueError, match="grad_itemsize=8"):
        R.optimizer_bytes_per_param(8)


def test_the_policy_holds_the_optimizer_state_it_is_given():
    dims = M.LayerDims(hidden=64, kv=32, intermediate=176, numel=50_000)
    base = dict(dims=dims, n_layers=4, itemsize=2, vocab=256, loss_chunk=256, tile_setting=None,
                offload_setting=False, budget=1 << 30, fixed_bytes=0)
    fp32, bf16 = M.LongContextPolicy(**base), M.LongContextPolicy(**base, optimizer_bytes=R.optimizer_bytes_per_param(2))
    fp32.hold_optimizer(2, 1000)
    bf16.hold_optimizer(2, 1000)
    assert bf16.fixed_bytes - fp32.fixed_bytes == (2 * dims.numel + 1000) * 2
    assert R.plan_optimizer(4, 1000, 0, 33_000, 16) == 2 and R.plan_optimizer(4, 1000, 0, 33_000, 18) == 1


def test_hyper_connection_boundaries_are_streams_times_hidden():
    """DeepSeek-V4's layers pass hc_mult residual streams, each hidden wide (measured on the model's own layer
    input); the plan's boundary activation is that many times a plain model's."""
    tokens = 8
    cfg, _, shape = small_v4_layer_input(tokens)
    per_token = shape.numel() // tokens
    assert per_token == M.residual_streams(cfg) * cfg.hidden_size == 2 * 64
    dims = M.LayerDims(hidden=64, kv=32, intermediate=32, numel=1, streams=M.residual_streams(cfg))
    assert M.boundary_bytes(dims, tokens, 2) == per_token * tokens * 2
    plain = M.LayerDims(hidden=64, kv=32, intermediate=32, numel=1)
    base = dict(n_layers=4, itemsize=2, vocab=256, loss_chunk=256, tile_setting=None, offload_setting=False,
                budget=None, fixed_bytes=0)
    grow = M.LongContextPolicy(dims=dims, **base).plan(1024).predicted_peak_bytes - M.LongContextPolicy(
        dims=plain, **base).plan(1024).predicted_peak_bytes
    assert grow == 4 * 1024 * 64 * 2  # every kept boundary one hidden-wide stream more
    assert M.residual_streams(copy.deepcopy(tiny_model("llama").config)) == 1
