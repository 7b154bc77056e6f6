"""The planner's device plan counts what the review of the CUDA path listed (issue 57, item 4), each against the
model or a measurement: Gemma 4's per-layer input table on the device (and in the host's pinned staging, as the
engine's preflight counts it) and its dense gradient every micro-batch;
hyper-connection boundaries as wide as every residual stream (DeepSeek-V4's hc_mult, read off the config through
the meta shapes); the device optimizer's FP32 work buffer beside bf16 gradient slabs. (The fourth, the logits an
HF/TRL loss holds, is the baselines' T x V x (c + 12): 14 B per token x vocab on bf16 logits, the figure
test_device_plan_items measures; megatrain's plan trains with labels, its tiled loss.)"""

from __future__ import annotations

import pytest
import torch
import transformers
from test_long_context_streams import small_v4_layer_input

from megatrain.costs import memory as M
from megatrain.costs import residency as R
from megatrain.costs.pinning import pinned_bytes
from megatrain.planner import plan
from megatrain.planner.hardware import get_hardware
from megatrain.planner.memory import layer_dims
from megatrain.planner.shapes import resolve_model

SIDE_ROW = "side parameters' gradient (dense)"


def _gemma4(**small: int) -> transformers.PretrainedConfig:
    """Gemma 4's text config: its defaults (E2B's shape: 30 layers, a 262144 x (30 x 256) per-layer input table),
    or a CPU-sized one."""
    return transformers.AutoConfig.for_model("gemma4_text", **small)


def _side_numel(model: torch.nn.Module) -> tuple[int, int]:
    """(the parameters beside the layers, embedding, head and final norm; the per-layer input table's), counted on
    the built model by name: what the engine keeps on the device beside the embedding."""
    layers = {id(p) for p in model.model.layers.parameters()}
    skip = layers | {id(model.model.embed_tokens.weight), id(model.lm_head.weight), id(model.model.norm.weight)}
    side = sum(p.numel() for p in model.parameters() if id(p) not in skip)
    return side, model.model.embed_tokens_per_layer.weight.numel()


def test_gemma4_per_layer_table_and_its_dense_gradient_are_planned():
    cfg = _gemma4()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    side, table = _side_numel(model)
    m = resolve_model(cfg)
    assert m.side_params == side and table <= side < 1.01 * table
    assert 4.0e9 < table * 2 < 4.1e9  # the "~4.7 GB bf16 at E2B" is Gemma 3n's 35-layer table
    # the engine's device globals: every parameter outside the layers (engine/host/preflight.py sums their shapes)
    layer_ids = {id(p) for p in model.model.layers.parameters()}
    globals_ = sum(p.numel() for p in model.parameters() if id(p) not in layer_ids)
    assert m.global_params() == globals_
    # on CUDA their gradients leave, and their bf16 copies go up, through pinned staging of all of them
    pin = pinned_bytes(m.layer_sizes(), globals_, 2, True, 2)
    rows = []
    for tokens in (128, 4096):
        pl = plan(cfg, tokens, hardware="h200-sxm", dtype="bfloat16")
        dev, lc = pl.memory.device, pl.long_context
        assert dev["embedding/head/norm"] == globals_ * 2 == (m.embed_params() + side + cfg.hidden_size) * 2
        host = pl.memory.host
        assert host["head gradient copy"] == pin["resident grad staging"] >= side * 2
        assert host["resident upload staging"] == pin["resident upload staging"] >= side * 2
        # the table's gradient, dense, after the layers' backward, when the boundaries and the layer's or the
        # loss's working set are gone: what it needs beyond them
        assert dev[SIDE_ROW] == max(0, side * 2 - lc.boundary_bytes - lc.working_bytes)
        # the peak holds that phase: the resident weights (the table's among them) and the gradient at once
        assert pl.memory.device_total - dev["runtime"] >= lc.resident_weight_bytes + side * 2
        rows.append(dev[SIDE_ROW])
    # at 128 tokens the head's loss phase is smaller than the table's gradient; at 4096 it is not
    assert rows[0] > 0 == rows[1]
    # a model without side parameters has no such row's bytes, and its globals are embedding, head and norm
    plain = plan("qwen2.5-1.5b", 4096, hardware="h200-sxm")
    assert plain.memory.device[SIDE_ROW] == 0 and resolve_model("qwen2.5-1.5b").side_params == 0


def test_the_per_layer_tables_gradient_is_dense_every_backward():
    """Measured: one backward of a small Gemma 4 gives the table a dense gradient of its full size, and every other
    side parameter one of its own size: side_params x the compute dtype's bytes."""
    cfg = _gemma4(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32, vocab_size=256, vocab_size_per_layer_input=256,
                  hidden_size_per_layer_input=16, global_head_dim=32)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    ids = torch.randint(3, 256, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    side, table = _side_numel(model)
    t = model.model.embed_tokens_per_layer.weight.grad
    assert t is not None and t.layout == torch.strided and t.numel() == table
    layers = {id(p) for p in model.model.layers.parameters()}
    skip = layers | {id(model.model.embed_tokens.weight), id(model.lm_head.weight), id(model.model.norm.weight)}
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()
                if id(p) not in skip and p.grad is not None)
    m = resolve_model(cfg)
    assert grads == m.side_params * 2 == side * 2


def test_hyper_connection_boundaries_are_every_stream():
    """DeepSeek-V4 (hc_mult 2): the planner's shape carries the streams from the config, its boundary is the
    layer input measured on the model, and the plan's boundary activations are that wide."""
    tokens = 8
    cfg, _, shape = small_v4_layer_input(tokens)
    m = resolve_model(cfg)
    assert m.residual_streams == M.residual_streams(cfg) == 2
    assert m.boundary_width * tokens == shape.numel()
    assert layer_dims(m).streams == 2
    T = 512
    pl = plan(cfg, T, hardware="cpu", dtype="float32", offload_activations=False, residency="stream")
    lc = pl.long_context
    assert pl.memory.device["boundary activations"] == lc.kept_boundaries * T * m.hidden * 2 * 4
    off = plan(cfg, T, hardware="cpu", dtype="float32", offload_activations=True, residency="stream")
    assert off.memory.host["offloaded activations"] == m.num_layers * T * m.boundary_width * 4
    assert resolve_model("qwen2.5-1.5b").residual_streams == 1


@pytest.mark.parametrize("grad_dtype,per_param", [("float32", 16), ("bfloat16", 18)])
def test_the_device_optimizers_work_buffer_with_bf16_slabs(grad_dtype, per_param):
    """An optimizer-resident layer's device state per parameter is what resident.move allocates
    (test_device_plan_items measures 16 B and 18 B): with bf16 slabs the FP32 work buffer too."""
    assert R.optimizer_bytes_per_param(2 if grad_dtype == "bfloat16" else 4) == per_param
    kw = dict(hardware="h200-sxm", batch=1, host_master="fp32", host_grad_dtype=grad_dtype,
              residency={"weights": 28, "optimizer": 4})
    pl = plan("qwen2.5-7b", 4096, **kw)
    lc, m = pl.long_context, pl.point.model
    assert lc.residency.optimizer == 4
    assert lc.optimizer_state_bytes == m.largest_layer_params() * per_param
    assert pl.memory.device["optimizer-resident layers' FP32 master, gradients, Adam m and v"] == \
        4 * m.largest_layer_params() * per_param
    assert lc.globals_state_bytes == (m.param_count() - m.num_layers * m.layer_params()) * per_param
    assert get_hardware("h200-sxm").device_bytes > pl.memory.device_total
