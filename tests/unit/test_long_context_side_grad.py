"""The engine's own device policy counts the side parameters' dense gradient (issue 57, item 4): Gemma 3n's and
Gemma 4's per-layer input table and its projection get a gradient in the compute dtype every micro-batch, after the
layers' backward (engine/layer/side_inputs.py). The policy's peak holds what it needs beyond the boundary
activations and the working set gone by then, the same bytes as the planner's device row; the "auto" tile, offload
and residency choices are made against that peak. A model without side parameters plans exactly as before."""

from __future__ import annotations

import dataclasses

import torch
import transformers

from megatrain.config import EngineConfig
from megatrain.costs import memory as M
from megatrain.engine import Engine
from megatrain.models.side import side_numel
from megatrain.planner import plan
from megatrain.planner.shapes import resolve_model

SIDE_ROW = "side parameters' gradient (dense)"
TOKENS = 32


def _gemma4() -> transformers.PreTrainedModel:
    """A CPU-sized Gemma 4 whose per-layer input table (4096 x 3 x 64) outweighs its layers' working set at
    TOKENS tokens, so its dense gradient sets the peak."""
    cfg = transformers.AutoConfig.for_model(
        "gemma4_text", hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=256, vocab_size_per_layer_input=4096,
        hidden_size_per_layer_input=64, num_kv_shared_layers=0, max_position_embeddings=512, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _llama() -> transformers.PreTrainedModel:
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _engine_policy(model: torch.nn.Module) -> tuple[Engine, M.LongContextPolicy]:
    eng = Engine(model, EngineConfig(device="cpu", compute_dtype="float32", parity_probe=False,
                                     offload_activations=False, mlp_tile_tokens=None, loss_chunk_tokens=TOKENS))
    return eng, eng.pipeline.policy


def _side_by_name(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The side parameters found on the built model by name, not through side_numel."""
    skip = {id(p) for p in model.model.layers.parameters()} | {
        id(model.model.embed_tokens.weight), id(model.lm_head.weight), id(model.model.norm.weight)}
    return [p for p in model.parameters() if id(p) not in skip]


def _by_name(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in _side_by_name(model))


def _no_side_peak(policy: M.LongContextPolicy, bp: M.BatchPlan) -> int:
    """The batch's peak as the policy counts it without the side gradient: fixed bytes, kept boundaries, and the
    layer's or the loss's working set, the larger."""
    d, c = policy.dims, policy.itemsize
    working = max(M.layer_working_bytes(d, TOKENS, bp.tile, c),
                  M.loss_workspace_bytes(TOKENS, d.hidden, policy.vocab, bp.loss_chunk, c))
    return policy.fixed_bytes + policy.n_layers * M.boundary_bytes(d, TOKENS, c) + working


def test_gemma4_engine_policy_counts_the_side_gradient_as_the_planner_row():
    model = _gemma4()
    side = _by_name(model)
    table = model.model.embed_tokens_per_layer.weight.numel()
    assert table == 4096 * 3 * 64 and table <= side
    eng, policy = _engine_policy(model)
    # one count for the engine and the planner: the engine's parts, the planner's meta shapes, the model by name
    assert side_numel(eng.parts) == resolve_model(model.config).side_params == side
    assert policy.side_grad_bytes == side * 4  # FP32 compute: the gradient's itemsize
    bp = policy.plan(TOKENS)
    assert not bp.offload and bp.tile is None and bp.loss_chunk == TOKENS
    base = _no_side_peak(policy, bp)
    term = side * 4 - (base - policy.fixed_bytes)  # beyond the boundaries and the working set
    assert term > 0 and bp.side_gradient_bytes == term
    assert bp.predicted_peak_bytes == base + term == policy.fixed_bytes + side * 4
    # the same policy without the side parameters: the peak it had before, short of exactly those bytes
    without = dataclasses.replace(policy, side_grad_bytes=0).plan(TOKENS)
    assert without.predicted_peak_bytes == base == bp.predicted_peak_bytes - term
    # a no-grad forward has no backward: no side gradient
    assert policy.plan(TOKENS, train=False).side_gradient_bytes == 0
    # measured: one engine backward gives every side parameter a dense gradient of its own size, the table's
    # included: the bytes the policy counts
    ids = torch.randint(0, 256, (1, TOKENS))
    eng.backward(eng(input_ids=ids, labels=ids).loss)
    grads = [p.grad for p in _side_by_name(model)]
    assert all(g is not None and g.layout == torch.strided for g in grads)
    assert sum(g.numel() * g.element_size() for g in grads) == policy.side_grad_bytes
    # the planner's device row for the same model and settings is the engine policy's term
    pl = plan(model.config, TOKENS, hardware="cpu", dtype="float32", offload_activations=False,
              mlp_tile_tokens=None, loss_chunk_tokens=TOKENS)
    lc = pl.long_context
    assert (lc.boundary_bytes, lc.working_bytes) == (policy.n_layers * M.boundary_bytes(policy.dims, TOKENS, 4),
                                                     base - policy.fixed_bytes - lc.boundary_bytes)
    assert pl.memory.device[SIDE_ROW] == bp.side_gradient_bytes


def test_a_side_gradient_under_a_budget_shrinks_what_auto_residency_keeps():
    """Under a device budget "auto" residency keeps layers' weights in the room the peak leaves: the side
    gradient's bytes are no longer that room (they overcommitted the device before)."""
    eng, policy = _engine_policy(_gemma4())
    # "auto" from scratch: no optimizer-resident layers (whose weights are always kept), nothing placed yet
    base = dataclasses.replace(policy, side_grad_bytes=0, residency="auto", optimizer=0, _weights=None)
    without = dataclasses.replace(base).plan(TOKENS)
    assert without.side_gradient_bytes == 0
    # a budget whose headroom holds the peak without the side gradient (no budget: no weights in it) and room for
    # every layer's weights (residency.plan asks the room for all of them before it frees the ring), no more
    assert base.budget is None
    need = without.predicted_peak_bytes + policy.n_layers * policy.dims.numel * policy.itemsize
    budget = -(-need * 10 // 9)
    assert int(M.BUDGET_HEADROOM * budget) >= need
    free = dataclasses.replace(base, budget=budget).plan(TOKENS)
    held = dataclasses.replace(base, budget=budget, side_grad_bytes=policy.side_grad_bytes).plan(TOKENS)
    assert free.residency.weights == policy.n_layers > held.residency.weights
    assert held.side_gradient_bytes > 0 and held.predicted_peak_bytes <= M.BUDGET_HEADROOM * budget


def test_a_llama_policy_is_unchanged():
    model = _llama()
    eng, policy = _engine_policy(model)
    assert side_numel(eng.parts) == _by_name(model) == 0 and policy.side_grad_bytes == 0
    for train in (True, False):
        bp = policy.plan(TOKENS, train=train)
        assert bp.side_gradient_bytes == 0
    bp = policy.plan(TOKENS)
    assert bp.predicted_peak_bytes == _no_side_peak(policy, bp)
    pl = plan(model.config, TOKENS, hardware="cpu", dtype="float32", offload_activations=False,
              mlp_tile_tokens=None, loss_chunk_tokens=TOKENS)
    assert pl.memory.device[SIDE_ROW] == 0
