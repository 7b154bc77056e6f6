"""A mixture-of-experts sweep point: FLOPs from the active parameters, bytes from the total (no training run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments.point import flops_per_step
from experiments.runner import point_columns
from experiments.spec import Point, load_sweep
from megatrain.models.presets import get_preset

SWEEPS = Path(__file__).resolve().parents[2] / "experiments" / "sweeps"


def _attention_flops(p, pt: Point) -> float:
    return 12.0 * p.num_layers * p.hidden * pt.seq_len * pt.tokens_per_step * 0.5


@pytest.mark.parametrize("model", ["tiny-mixtral", "small-moe"])
def test_moe_point_flops_count_the_top_k_experts_not_every_expert(model):
    pt = Point(backend="megatrain", model=model, seq_len=128, micro_batch=2)
    p = pt.preset
    e = p.moe
    T = pt.tokens_per_step
    # The same model with a dense SwiGLU as wide as the top-k experts together: the MoE's per-token compute
    # differs from it only by the router (hidden -> experts), counted by hand here, not by the preset.
    dense_eq = p.with_(family="llama", moe=None, intermediate=e.top_k * e.expert_intermediate)
    router_flops = 6.0 * T * p.num_layers * e.experts * p.hidden
    expected = 6.0 * T * (dense_eq.nonembed_params()) + router_flops + _attention_flops(p, pt)
    got = flops_per_step(pt)
    assert got == pytest.approx(expected, rel=1e-12)
    # Counting every stored expert (the total) would overstate the compute by the idle experts' share.
    idle = 6.0 * T * p.num_layers * (e.experts - e.top_k) * 3 * p.hidden * e.expert_intermediate
    assert 6.0 * T * p.nonembed_params() + _attention_flops(p, pt) == pytest.approx(got + idle, rel=1e-12)


def test_dense_point_flops_and_columns_are_unchanged():
    pt = Point(backend="torch", model="tiny", seq_len=64)
    p = pt.preset
    assert flops_per_step(pt) == pytest.approx(6.0 * 64 * p.nonembed_params() + _attention_flops(p, pt))
    row = point_columns(pt, "t")
    assert row["active_params"] == row["params"] == p.param_count()


def test_moe_row_carries_total_and_active_params():
    row = point_columns(Point(backend="torch", model="tiny-mixtral", seq_len=128), "moe")
    p = get_preset("tiny-mixtral")
    assert row["params"] == p.param_count() and row["active_params"] == p.active_param_count()
    assert row["active_params"] < row["params"]


def test_moe_sweep_spec_covers_moe_and_dense_presets():
    pts = load_sweep(SWEEPS / "moe.yaml").points
    assert {"megatrain", "torch"} <= {pt.backend for pt in pts}
    models = {pt.model for pt in pts}
    assert any(get_preset(m).is_moe for m in models) and any(not get_preset(m).is_moe for m in models)
    assert all(pt.warmup >= 1 and pt.steps >= 2 and pt.threads == 1 for pt in pts)


@pytest.mark.parametrize("model", ["small-moe"])
def test_sweep_moe_preset_counts_match_the_model_it_builds(model):
    """The row's params / active_params are the preset's counts: check them against the HF model (meta device)."""
    import torch
    import transformers

    p = get_preset(model)
    with torch.device("meta"):
        m = transformers.AutoModelForCausalLM.from_config(p.hf_config())
    share = p.moe.top_k / p.moe.experts
    named = list(m.named_parameters())
    assert any(".experts." in n for n, _ in named)
    assert p.param_count() == sum(t.numel() for _, t in named)
    assert p.active_param_count() == sum(t.numel() * (share if ".experts." in n else 1.0) for n, t in named)
