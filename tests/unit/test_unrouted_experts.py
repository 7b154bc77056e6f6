"""An expert no token was routed to sends no gradient and costs no reduction (issue 40): the layer's backward
returns None for a weight no gradient reaches (per-expert modules), the reducer skips it (and any slab-aligned
block of zeros, as an unrouted expert's rows of a fused experts tensor are), zeroing it on a slab's first write;
the slabs, norms and trained weights keep the bits of adding the zeros. Negative controls: the same training with
every gradient materialized (or the two torch passes) reduces more, and the counts catch it."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_batches, tiny_model
from kit import same_run, train_steps
from torch import nn

from megatrain.config.schema import EngineConfig
from megatrain.engine import Engine
from megatrain.engine.host import reduce_kernel as R

ACCUM, STEPS = 2, 3
BATCHES = make_batches(ACCUM * STEPS, batch=1, seq=6)  # 6 tokens a micro-batch: most of 8 experts get none


class PerExpertMoE(nn.Module):
    """Top-1 routing to experts that are modules of their own (as remote-code and older MoE layers are)."""

    def __init__(self, hidden: int, experts: int = 8, width: int = 32) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(hidden, width, bias=False), nn.SiLU(),
                                                   nn.Linear(width, hidden, bias=False)) for _ in range(experts))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        flat = h.reshape(-1, h.shape[-1])
        probs = self.gate(flat).softmax(-1)
        weight, idx = probs.max(-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows = (idx == e).nonzero().flatten()
            if rows.numel():
                out = out.index_add(0, rows, expert(flat[rows]) * weight[rows, None])
        return out.reshape(h.shape)


@pytest.fixture(scope="module")
def per_expert():
    model = tiny_model("llama", layers=2)
    torch.manual_seed(1)
    for layer in model.model.layers:
        layer.mlp = PerExpertMoE(model.config.hidden_size)
    return model


@pytest.fixture(scope="module")
def fused():
    import transformers

    cfg = transformers.AutoConfig.for_model(
        "mixtral", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
        max_position_embeddings=512, tie_word_embeddings=False, intermediate_size=64, num_local_experts=8,
        num_experts_per_tok=1)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _train(model) -> tuple[list[float], dict[str, torch.Tensor], R.Tally, int]:
    eng = Engine(copy.deepcopy(model), EngineConfig(device="cpu", parity_probe=False))
    _, norms = train_steps(eng, BATCHES, STEPS, accum=ACCUM, clip=0.05)
    eng.synchronize()
    slab_elems = sum(g.numel for g in eng.store.layers) * ACCUM * STEPS  # what adding every gradient takes
    return norms, eng.state_dict(), eng.events.slabs.tally, slab_elems


def _materialized(monkeypatch) -> None:
    grad = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: grad(*a, **{**k, "materialize_grads": True}))


def test_an_unrouted_expert_sends_no_gradient_and_the_bits_are_unchanged(per_expert, monkeypatch):
    got = _train(per_expert)
    tally, total = got[2], got[3]
    assert tally.absent > 0  # whole experts had no gradient: None, not zeros
    assert tally.reduced + tally.skipped == total and tally.reduced < total
    _materialized(monkeypatch)  # control: zeros for every unrouted expert, added as before
    want = _train(per_expert)
    assert want[2].absent == 0
    assert same_run(got[:2], want[:2])


def test_a_fused_experts_unrouted_rows_cost_no_add_and_the_bits_are_unchanged(fused, monkeypatch):
    got = _train(fused)
    tally, total = got[2], got[3]
    assert tally.absent == 0 and tally.skipped > 0 and tally.reduced + tally.skipped == total
    monkeypatch.setattr(R._KERNEL, "state", None)  # control: no kernel, the two torch passes add every zero
    want = _train(fused)
    assert want[2].skipped == 0 and want[2].reduced == total
    assert same_run(got[:2], want[:2])


def test_a_dense_model_skips_nothing():
    norms, _, tally, total = _train(tiny_model("llama", layers=2))
    assert tally.skipped == 0 and tally.reduced == total


@pytest.mark.parametrize("first", [True, False])
def test_absent_parts_and_zero_blocks_are_skipped_with_the_bits_of_adding_zeros(first):
    lib = R.kernel()
    assert lib is not None
    n, zb = 8 * R.ZERO_BLOCK, R.ZERO_BLOCK
    g = torch.randn(n).to(torch.bfloat16)
    g[zb: 4 * zb] = 0  # three aligned blocks of zeros (an unrouted expert's rows)
    g[3 * zb: 3 * zb + 5] = -0.0  # signed zeros in the third: still zeros
    g[5 * zb + 1] = 0  # a lone zero in a dense block: added as usual
    slab = torch.randn(n) * 7  # the last step's bytes: a first write must not keep them
    parts = [(0, g[: 6 * zb]), (6 * zb, None)]  # the last two blocks: no gradient at all
    want = slab.clone()
    dense = g.float()
    dense[6 * zb:] = 0
    if first:
        torch.add(dense, 0.0, out=want)
    else:
        want.add_(dense)
    tally = R.Tally()
    norm, finite = R.reduce_and_norm(lib, slab, parts, first, 2, True, tally)
    assert torch.equal(slab.view(torch.int32), want.view(torch.int32))
    assert int(norm.view(torch.int32)) == int(torch.linalg.vector_norm(want).view(torch.int32)) and finite
    assert (tally.skipped, tally.absent) == (5 * zb, 2 * zb)  # blocks 1-3 (zeros, signed ones too), 6 and 7
    assert tally.reduced == 3 * zb
