"""The planner: bytes/param formulas, sums, the link crossover, fit searches, profiles, CLI."""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path

import pandas as pd
import pytest
import yaml
from plan_cli import main  # --details: the tables these tests read

from megatrain.commands.plan import add_bench_parser, add_plan_parser
from megatrain.costs.flops import model_flops_per_step
from megatrain.costs.host_memory import host_memory_available
from megatrain.models.presets import PRESETS, get_preset
from megatrain.planner import (
    crossover_closed_form,
    get_hardware,
    load_profiles,
    make_point,
    max_batch,
    max_context,
    plan,
    preflight,
    resolve_model,
)

# the planner's internals, where these tests check them
from megatrain.planner.hardware import NUMERIC_FIELDS, OVERHEAD_FIELDS, load_raw
from megatrain.planner.memory import layer_working_set_bytes
from megatrain.planner.search import fits
from megatrain.planner.step_time import IDLE_ROUND, link_crossover_tokens

REPO = Path(__file__).resolve().parents[2]

GIB = 1024**3
H200 = "h200-pcie"


def _states(pl) -> int:
    h = pl.memory.host
    return h["master weights"] + h["gradients"] + h["adam m"] + h["adam v"]


# ------------------------------------------------------------------ bytes per parameter


@pytest.mark.parametrize("name", ["llama2-7b", "qwen2.5-14b", "dense-120b", "tiny-qwen2"])
def test_fp32_host_state_is_16_bytes_per_param(name):
    # (residency "stream": every layer's state on the host; "auto" keeps some layers' optimizer on the device)
    pl = plan(name, 1024, 1, dtype="float32", hardware=H200, offload_activations=False, residency="stream")
    P = PRESETS[name].param_count()
    assert _states(pl) == 16 * P
    assert pl.memory.host["bf16 shadow (streams)"] == 0


def test_bf16_shadow_covers_streamed_layers_only():
    m = get_preset("qwen2.5-7b")
    pl = plan(m, 1024, dtype="bfloat16", hardware=H200, residency="stream")  # every layer's state on the host
    assert pl.memory.host["bf16 shadow (streams)"] == 2 * m.num_layers * m.layer_params()
    assert _states(pl) == 16 * m.param_count()
    # the exact hi/lo split streams its hi half: no shadow
    assert plan(m, 1024, dtype="bfloat16", hardware=H200, master="hilo").memory.host["bf16 shadow (streams)"] == 0
    # the paper's public code: bf16 weights + bf16 grads + fp32 Adam = 12 B/param for the streamed layers; the
    # engine keeps the globals (embedding, head, norm) FP32 with an FP32 gradient: 16 B/param
    paper = plan(m, 1024, dtype="bfloat16", hardware=H200, master="bf16", host_grad_dtype="bfloat16")
    n_layers = m.num_layers * m.layer_params()
    assert _states(paper) == 12 * n_layers + 16 * (m.param_count() - n_layers)


@pytest.mark.parametrize("master,grad,oib", [("fp32", "float32", False), ("hilo", "float32", False),
                                             ("hilo", "bfloat16", False), ("hilo", "float32", True),
                                             ("bf16", "bfloat16", False), ("fp32", "float32", True)])
def test_planner_layer_bytes_are_the_engine_modes(master, grad, oib):
    """The planner charges what megatrain/costs/modes.py (which the engine's store allocates by) says."""
    from megatrain.costs.modes import GradSlab, HostMaster, layer_bytes_per_param

    m = get_preset("qwen2.5-7b")
    pl = plan(m, 1024, hardware=H200, master=master, host_grad_dtype=grad, optimizer_in_backward=oib,
              grad_clip=not oib, residency="stream")  # every layer's state on the host
    h, n_layers = pl.memory.host, m.num_layers * m.layer_params()
    glob = m.param_count() - n_layers
    layer_state = _states(pl) + h["bf16 shadow (streams)"] - 16 * glob
    assert layer_state == layer_bytes_per_param(HostMaster(master), GradSlab(grad), oib, True) * n_layers
    assert not any("refuses" in w for w in pl.warnings)


def test_modes_the_engine_refuses_are_noted_not_silently_planned():
    m = get_preset("qwen2.5-7b")
    # a mode the engine's config refuses as written (hilo in FP32 compute) is refused by the point's EngineConfig
    with pytest.raises(ValueError, match="host_master='hilo'.*compute_dtype='bfloat16'"):
        plan(m, 1024, hardware=H200, master="hilo", dtype="float32")
    for knobs, why in ((dict(optimizer_in_backward=True), "refuses gradient clipping"),
                       (dict(optimizer_in_backward=True, grad_clip=False, grad_accum=2), "accumulation"),
                       (dict(host_grad_dtype="bfloat16", grad_accum=2), "accumulation")):
        assert any("the engine refuses" in w and why in w for w in plan(m, 1024, hardware=H200, **knobs).warnings)
    assert not any("refuses" in w for w in plan(m, 1024, hardware=H200, optimizer_overlap=True).warnings)


def test_zero3_host_is_what_deepspeed_allocates():
    # stage3.py with offloaded optimizer and parameters, bf16: FP32 master, FP32 gradient, Adam m and v
    # (16 B), the bf16 gradient-accumulation partition and the bf16 parameter partition (2 + 2 B), and
    # the user's FP32 model, whole until DeepSpeed partitions it (4 B); no estimator margin.
    m = get_preset("qwen2.5-14b")
    z = plan(m, 1024, backend="zero3", hardware=H200)
    states = z.memory.host_total - z.memory.host["runtime"] - z.memory.host["deepspeed runtime"]
    assert states == 24 * m.param_count()
    # ZeRO-2 keeps the bf16 parameters on the device instead
    z2 = plan(m, 1024, backend="zero3", hardware=H200, zero_stage=2)
    assert z.memory.host_total - z2.memory.host_total == 2 * m.param_count()
    assert z2.memory.device["params (compute dtype)"] == 2 * m.param_count()


def test_zero3_host_memory_against_real_deepspeed_rss():
    """The quick sweep's real DeepSpeed runs (results/quick): peak RSS vs the planner, the smallest point
    having fixed the runtime constant, the others held out."""
    df = pd.read_csv(REPO / "results" / "quick" / "results.csv")
    rows = df[(df["backend"] == "zero3") & (df["model"] != "tiny")]
    assert len(rows) >= 3
    for _, r in rows.iterrows():
        pl = plan(r["model"], int(r["seq_len"]), int(r["micro_batch"]), dtype="float32", hardware="cpu",
                  backend="zero3")
        err = pl.memory.host_total_incl_device / r["peak_host_rss_bytes"] - 1
        assert abs(err) <= 0.10, (r["label"], err)
        if r["params"] > 50e6:  # where the states dominate the runtime, the check can tell them apart:
            # negative control: DeepSpeed's estimator margin (x1.5 on the model states) booked as memory
            states = sum(v for k, v in pl.memory.host.items() if "runtime" not in k)
            assert (pl.memory.host_total_incl_device + 0.5 * states) / r["peak_host_rss_bytes"] - 1 > 0.10
    assert (rows["params"] > 50e6).any()


def test_param_counts_match_design_table():
    # DESIGN.md's approximate sizes, to the stated precision
    expect = {"llama2-7b": 6.7e9, "qwen2.5-7b": 7.6e9, "llama3.1-8b": 8.0e9, "qwen2.5-14b": 14.8e9,
              "qwen2.5-32b": 32.8e9, "llama3.1-70b": 70.6e9, "qwen2.5-72b": 72.7e9, "dense-120b": 122e9}
    for name, n in expect.items():
        assert PRESETS[name].param_count() == pytest.approx(n, rel=0.01), name


# ------------------------------------------------------------------ sums and formulas


@pytest.mark.parametrize("backend", ["megatrain", "zero3", "torch"])
def test_components_sum_to_totals(backend):
    pl = plan("qwen2.5-14b", 4096, 2, grad_accum=3, hardware=H200, backend=backend)
    assert pl.memory.host_total == sum(pl.memory.host.values())
    assert pl.memory.device_total == sum(pl.memory.device.values())
    t = pl.time
    if backend == "megatrain":  # forward includes the first load; fill_drain_s is the step's final drain
        step = 3 * (t.forward_s + t.head_s + t.backward_s) + t.fill_drain_s
    else:
        step = 3 * (t.fill_drain_s + t.forward_s + t.head_s + t.backward_s)
    # megatrain: and the resident masters' rounding into the upload staging, serial on the launch thread
    assert t.step_s == pytest.approx(step + t.embed_io_s + t.optimizer_s + t.idle_s.get(IDLE_ROUND, 0.0), rel=1e-9)
    assert pl.tokens_per_s == pytest.approx(3 * 2 * 4096 / t.step_s)


def test_link_bytes_per_step():
    m = get_preset("llama3.1-8b")
    k, g = 2, 2
    pl = plan(m, 2048, 4, grad_accum=g, hardware=H200, residency="stream", num_buffers=k, offload_activations=False)
    c, L, PL, T = 2, m.num_layers, m.layer_params(), 4 * 2048
    resident = m.embed_params() + m.hidden
    # the first micro-batch loads every layer forward and all but the k resident at the turn backward;
    # the next one starts with layers 0..k-1 still resident from the backward before it (schedule.py)
    loads = (2 * L - k) + (g - 1) * (2 * L - 2 * k)
    assert pl.time.h2d_bytes == loads * PL * c + resident * c  # + the globals' upload after the step
    # every layer's gradient per micro-batch, + the head/norm gradient and the embedding rows' (engine.py)
    assert pl.time.d2h_bytes == g * L * PL * c + g * (m.vocab * m.hidden + m.hidden + T * m.hidden) * c
    # offloaded activations cross the link both ways, one boundary tensor per layer
    off = plan(m, 2048, 4, grad_accum=g, hardware=H200, residency="stream", num_buffers=k, offload_activations=True)
    assert off.time.h2d_bytes - pl.time.h2d_bytes == g * L * T * m.hidden * c
    assert off.time.d2h_bytes - pl.time.d2h_bytes == g * L * T * m.hidden * c


def test_cpu_device_in_fp32_moves_no_embedding_or_head():
    # Engine._alias_globals: on a CPU device in FP32 the device embedding/head/norm are the host masters
    m = get_preset("small-7m")
    pl = plan(m, 128, dtype="float32", hardware="cpu", residency="stream")
    c, L, PL, k = 4, m.num_layers, m.layer_params(), 2
    assert pl.time.embed_io_s == 0
    assert pl.time.h2d_bytes == (2 * L - k) * PL * c  # the weight stream only, as the engine counts it
    assert pl.time.d2h_bytes == L * PL * c
    assert pl.memory.shared == (m.embed_params() + m.hidden) * c  # one allocation, listed on both sides
    assert pl.memory.host_total_incl_device == pl.memory.host_total + pl.memory.device_total - pl.memory.shared
    # in bf16 the CPU engine keeps bf16 copies (casts, no link); on a GPU they cross the link
    bf16 = plan(m, 128, dtype="bfloat16", hardware="cpu", residency="stream")
    assert bf16.time.embed_io_s > 0 and bf16.time.h2d_bytes == (2 * L - k) * PL * 2 and bf16.memory.shared == 0
    gpu = plan(m, 128, dtype="float32", hardware=H200, residency="stream")
    assert gpu.time.h2d_bytes == pl.time.h2d_bytes + (m.embed_params() + m.hidden) * c


def test_model_flops_use_the_shared_definition():
    m = get_preset("llama2-7b")
    pl = plan(m, 8192, 2, grad_accum=2, hardware="gh200")
    want = model_flops_per_step(m.nonembed_params(), m.num_layers, m.hidden, 8192, 2 * 2 * 8192)
    assert pl.model_flops == want
    assert pl.model_tflops == pytest.approx(want / pl.time.step_s / 1e12)
    assert pl.mfu == pytest.approx(want / pl.time.step_s / 989e12)


def test_one_buffer_serializes_copies():
    # the ring at work: every layer streamed (residency "auto" keeps all 32 here, and kept layers' refreshes are
    # issued ahead of the ring, so one buffer or two would not differ)
    a = plan("llama3.1-8b", 1024, 1, hardware=H200, num_buffers=2, offload_activations=False, residency="stream")
    b = plan("llama3.1-8b", 1024, 1, hardware=H200, num_buffers=1, offload_activations=False, residency="stream")
    la, lb = a.time.layer, b.time.layer
    assert la.fwd == pytest.approx(max(la.fwd_compute, la.fwd_h2d, la.fwd_d2h))
    assert lb.fwd == pytest.approx(lb.fwd_compute + lb.fwd_h2d + lb.fwd_d2h)
    assert b.time.step_s > a.time.step_s


# ------------------------------------------------------------------ the link crossover


def test_crossover_closed_form_is_phi_over_b():
    hw = get_hardware(H200)
    assert crossover_closed_form(hw, "bfloat16") == pytest.approx(hw.sustained_flops("bfloat16") / hw.link_bps)
    assert crossover_closed_form(hw, "float32") == pytest.approx(2 * hw.sustained_flops("float32") / hw.link_bps)
    # DESIGN.md: about 13k tokens on H200/PCIe, 1.6k on GH200 (bf16)
    assert 8_000 < crossover_closed_form(hw, "bfloat16") < 20_000
    assert 1_000 < crossover_closed_form(get_hardware("gh200"), "bfloat16") < 3_000


def test_forward_is_link_bound_below_the_crossover_and_compute_bound_above():
    m, hw, ctx = get_preset("qwen2.5-14b"), get_hardware(H200), 1024
    n = link_crossover_tokens(make_point(m, ctx, 1), hw)
    # attention and elementwise work only lower it below the GEMM-only closed form
    assert n < crossover_closed_form(hw, "bfloat16")
    below = plan(m, ctx, max(1, math.floor(n / ctx) - 1), hardware=hw)
    above = plan(m, ctx, math.ceil(n / ctx) + 1, hardware=hw)
    assert below.time.layer.fwd == below.time.layer.fwd_h2d > below.time.layer.fwd_compute
    assert above.time.layer.fwd == above.time.layer.fwd_compute > above.time.layer.fwd_h2d
    exact = make_point(m, ctx, 1)
    from megatrain.planner.step_time import layer_compute as _layer_compute

    # a layer's forward = its fixed cost + a part linear in tokens; at n tokens it equals the load
    per_token = (_layer_compute(exact, hw)[0] - hw.layer_overhead_fwd_s) / ctx
    assert hw.layer_overhead_fwd_s + per_token * n == pytest.approx(m.layer_params() * 2 / hw.link_bps)
    # the fixed per-layer cost hides part of every load, so it lowers the crossover
    assert n < link_crossover_tokens(exact, hw.with_(layer_overhead_fwd_s=0.0))


def test_slow_link_makes_the_link_the_bottleneck():
    # every layer streamed ("auto" would keep every layer and its optimizer on the device: no link to bind)
    fast = plan("llama2-7b", 4096, 1, hardware=H200, residency="stream")
    slow = plan("llama2-7b", 4096, 1, hardware=H200, link_gbs=1.0, residency="stream")
    assert slow.time.bottleneck == "link"
    assert slow.time.copy_wait_s > fast.time.copy_wait_s
    assert slow.time.step_s > fast.time.step_s


# ------------------------------------------------------------------ device memory shape


def test_device_memory_is_independent_of_depth_with_offload():
    m = get_preset("llama2-7b")
    shallow = plan(m, 4096, 2, hardware=H200, residency="stream", offload_activations=True, mlp_tile_tokens=None)
    deep = plan(m.with_(num_layers=2 * m.num_layers), 4096, 2, hardware=H200, residency="stream", offload_activations=True,
                mlp_tile_tokens=None)
    assert deep.memory.device == shallow.memory.device
    assert deep.memory.host_total > shallow.memory.host_total
    # resident boundary activations are the one depth-dependent device term: L x T x h x c
    r1 = plan(m, 4096, 2, hardware=H200, residency="stream", offload_activations=False, mlp_tile_tokens=None)
    r2 = plan(m.with_(num_layers=2 * m.num_layers), 4096, 2, hardware=H200, residency="stream", offload_activations=False,
              mlp_tile_tokens=None)
    assert r2.memory.device_total - r1.memory.device_total == m.num_layers * 2 * 4096 * m.hidden * 2


def test_device_weight_bytes_are_buffers_plus_resident():
    m = get_preset("qwen2.5-7b")
    pl = plan(m, 1024, hardware=H200, residency="stream", num_buffers=3)
    assert pl.device_weight_bytes == 3 * m.layer_params() * 2 + (m.embed_params() + m.hidden) * 2


def test_working_set_is_linear_in_tokens_and_tiling_shrinks_it():
    from megatrain.engine.layer.tiling import LayerDims, layer_working_bytes

    m = get_preset("llama2-7b")
    ws = [layer_working_set_bytes(m, t, 2) for t in (4096, 8192, 16384, 32768)]
    assert ws[1] - ws[0] == pytest.approx((ws[3] - ws[2]) / 4, rel=1e-6)  # no quadratic term
    assert layer_working_set_bytes(m, 65536, 2, tile=4096) < layer_working_set_bytes(m, 65536, 2) * 0.6
    # the engine's own figure, not a copy of its coefficients
    dims = LayerDims(m.hidden, m.kv_heads * m.head_dim, m.intermediate, m.layer_params())
    assert layer_working_set_bytes(m, 65536, 2, tile=4096) == layer_working_bytes(dims, 65536, 4096, 2)


def test_long_context_auto_offloads_and_tiles():
    pl = plan("llama2-7b", 524288, 1, hardware="gh200")
    assert pl.fits
    assert pl.decisions["offload_activations"] is True
    assert pl.decisions["mlp_tile_tokens"] is not None
    assert pl.memory.host["offloaded activations"] == 32 * 524288 * 4096 * 2
    assert any("max_position_embeddings" in w for w in pl.warnings)
    forced = plan("llama2-7b", 524288, 1, hardware="gh200", offload_activations=False, mlp_tile_tokens=None)
    assert not forced.fits
    # the old knob name still works
    with pytest.warns(DeprecationWarning, match="mlp_tile_tokens"):
        old = plan("llama2-7b", 524288, 1, hardware="gh200", offload_activations=False, tile_tokens=None)
    assert old.memory.device == forced.memory.device


@pytest.mark.parametrize("hw", ["gh200", H200])
def test_long_context_device_is_the_engine_policys_prediction(hw):
    from megatrain.engine.layer import tiling

    m = get_preset("llama2-7b")
    pl = plan(m, 524288, 1, hardware=hw, residency="stream", offload_activations=True)
    lc = pl.long_context
    c, PL = 2, m.layer_params()
    policy = tiling.LongContextPolicy(
        dims=tiling.LayerDims(m.hidden, m.kv_heads * m.head_dim, m.intermediate, PL), n_layers=m.num_layers,
        itemsize=c, vocab=m.vocab, loss_chunk="auto", tile_setting="auto", offload_setting=True,
        budget=get_hardware(hw).device_bytes, fixed_bytes=2 * PL * c + (m.embed_params() + m.hidden) * c)
    bp = policy.plan(524288)
    assert (lc.offload, lc.tile, lc.peak_bytes) == (bp.offload, bp.tile, bp.predicted_peak_bytes)
    assert pl.memory.device_total - pl.memory.device["runtime"] == bp.predicted_peak_bytes
    assert lc.peak_bytes == lc.resident_weight_bytes + lc.boundary_bytes + max(lc.layer_working_bytes,
                                                                               lc.loss_workspace_bytes)
    assert pl.memory.host["offloaded activations"] == m.num_layers * 524288 * m.hidden * c


@pytest.mark.filterwarnings("ignore:.*device budget")  # the smallest budget is meant not to fit
def test_planner_matches_a_real_engines_policy():
    # the same shape through an Engine (its policy built from the real layer) and through the planner
    import torch
    import transformers

    from megatrain.config.schema import EngineConfig
    from megatrain.engine import Engine

    m = get_preset("tiny")
    torch.manual_seed(0)
    # no budget (a CPU device); roomy; tight enough to offload and tile; too small for anything
    for budget, tokens in ((None, 512), (64 * 1024**2, 8192), (14 * 1024**2, 8192), (2 * 1024**2, 4096)):
        cfg = EngineConfig(device="cpu", device_budget_bytes=budget, residency="stream")
        eng = Engine(transformers.AutoModelForCausalLM.from_config(m.hf_config()), config=cfg)
        bp = eng.pipeline.policy.plan(tokens)
        pl = plan(m, tokens, 1, dtype="float32", hardware="cpu", engine_config=cfg)
        lc = pl.long_context
        assert (lc.offload, lc.tile, lc.peak_bytes) == (bp.offload, bp.tile, bp.predicted_peak_bytes), budget
        assert pl.device_weight_bytes == eng.device_weight_bytes


# ------------------------------------------------------------------ monotonicity and fit


def test_monotone_in_batch_context_and_size():
    # streamed: "auto" fills the device budget (kept weights and graphs, optimizer state) at every batch
    dev = [plan("qwen2.5-14b", 4096, b, hardware=H200, offload_activations=False, mlp_tile_tokens=None,
                residency="stream") for b in (1, 2, 4, 8)]
    assert all(a.memory.device_total < b.memory.device_total for a, b in zip(dev, dev[1:]))
    assert all(a.time.step_s < b.time.step_s for a, b in zip(dev, dev[1:]))
    # tokens/s grows with the batch while the host update binds: without the speculative step. With it the update
    # hides in backward from 4 x 4096 on, and 8 x 4096 recomputes more layers (residency): 4 x is its peak here.
    serial = [plan("qwen2.5-14b", 4096, b, hardware=H200, offload_activations=False, mlp_tile_tokens=None,
                   speculative_step=False) for b in (1, 2, 4, 8)]
    assert all(a.tokens_per_s <= b.tokens_per_s for a, b in zip(serial, serial[1:]))
    ctx = [plan("qwen2.5-14b", s, 1, hardware=H200, offload_activations=False, mlp_tile_tokens=None,
                residency="stream").memory.device_total for s in (1024, 2048, 4096)]
    assert ctx == sorted(ctx)
    hosts = [plan(n, 1024, hardware=H200).memory.host_total for n in ("llama2-7b", "qwen2.5-14b", "qwen2.5-32b")]
    assert hosts == sorted(hosts)


def test_fit_cases():
    assert fits("tiny", 128, 1, hardware=H200)
    # 120B with an exact FP32 master + FP32 grads + Adam needs ~2 TB: not in the paper's 1.5 TB...
    full = plan("120b", 4096, 8, hardware=H200)
    assert not full.fits and "host" in full.reasons[0] and "DOES NOT FIT" in full.reasons[0]
    # ...while the paper's bf16 weights + bf16 grads (12 B/param) do fit
    assert fits("120b", 4096, 8, hardware=H200, master="bf16", host_grad_dtype="bfloat16")
    # 70B on a 192 GB desktop does not
    assert not fits("70b", 1024, 1, hardware="rtx4090")
    # HF's full logits keep ZeRO-3 to small batches where megatrain's chunked loss does not
    assert max_batch("qwen2.5-14b", 4096, hardware="a100-pcie", backend="zero3") < \
        max_batch("qwen2.5-14b", 4096, hardware="a100-pcie")


def test_max_batch_and_max_context_are_the_boundary():
    kw = dict(hardware="a100-pcie", offload_activations=False, mlp_tile_tokens=None)
    b = max_batch("qwen2.5-7b", 4096, **kw)
    assert b >= 1
    assert fits("qwen2.5-7b", 4096, b, **kw) and not fits("qwen2.5-7b", 4096, b + 1, **kw)
    s = max_context("qwen2.5-7b", 1, granularity=1024, **kw)
    assert s % 1024 == 0 and s >= 1024
    assert fits("qwen2.5-7b", s, 1, **kw) and not fits("qwen2.5-7b", s + 1024, 1, **kw)
    assert max_batch("120b", 4096, hardware=H200) == 0  # the host side never fits


# ------------------------------------------------------------------ errors and inputs


def test_clear_errors_for_bad_names_and_values():
    with pytest.raises(ValueError, match="unknown model preset 'llama2-7'. Did you mean 'llama2-7b'"):
        plan("llama2-7", 1024)
    with pytest.raises(ValueError, match="unknown hardware profile 'h200'.*Known profiles"):
        plan("7b", 1024, hardware="h200")
    with pytest.raises(ValueError, match="backend"):
        plan("7b", 1024, backend="zero2")
    with pytest.raises(ValueError, match="dtype"):
        plan("7b", 1024, dtype="float16")
    with pytest.raises(ValueError, match="batch=0"):
        plan("7b", 1024, 0)
    with pytest.raises(ValueError, match="unknown planner setting"):
        plan("7b", 1024, num_bufers=2)


def test_hf_config_dict_resolves_to_the_same_shape():
    m = get_preset("qwen2.5-7b")
    d = dict(model_type="qwen2", num_hidden_layers=m.num_layers, hidden_size=m.hidden,
             intermediate_size=m.intermediate, num_attention_heads=m.heads, num_key_value_heads=m.kv_heads,
             vocab_size=m.vocab, max_position_embeddings=m.max_positions, tie_word_embeddings=False)
    assert resolve_model(d).param_count() == m.param_count()
    real = resolve_model(get_preset("tiny-qwen2").hf_config())  # a transformers config object
    assert real.param_count() == get_preset("tiny-qwen2").param_count() and real.tie_embeddings
    # a head_dim other than hidden / heads (once refused) is read off the model built on the meta device
    wide = resolve_model({**d, "head_dim": 256})
    assert wide.head_dim == 256 and wide.param_count() > m.param_count()
    with pytest.raises(ValueError, match="'t5'.*causal LM"):  # what the engine cannot train is refused by name
        resolve_model({"model_type": "t5", "d_model": 64, "num_layers": 2, "num_heads": 4, "vocab_size": 256})
    # GPT-2 is a decoder the engine trains (models/adapter.py finds its parts): planned, counted as built
    import torch
    import transformers

    g = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128)
    with torch.device("meta"):
        built = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(g).parameters())
    assert resolve_model(g).param_count() == built


def test_engine_config_supplies_knobs():
    from megatrain.config.schema import EngineConfig

    cfg = EngineConfig(compute_dtype="bfloat16", num_buffers=3, loss_chunk_tokens=512, offload_activations=True,
                       mlp_tile_tokens=4096)
    p = make_point("7b", 1024, engine_config=cfg)
    assert (p.dtype, p.num_buffers, p.loss_chunk_tokens, p.offload_activations, p.mlp_tile_tokens) == \
        ("bfloat16", 3, 512, True, 4096)
    # the engine's device budget is what its "auto" plans against
    small = plan("7b", 65536, engine_config=EngineConfig(compute_dtype="bfloat16", device_budget_bytes=24 * GIB),
                 hardware=H200)
    assert small.hardware.device_bytes == 24 * GIB and small.decisions["offload_activations"] is True


# ------------------------------------------------------------------ profiles


def test_every_profile_number_has_a_source():
    raw = load_raw()
    shared = raw["sources"]
    assert all(isinstance(v, str) and v.strip() for v in shared.values())
    expected = {"h200-pcie", "gh200", "h100-sxm", "h100-pcie", "a100-pcie", "rtx4090", "cpu"}
    assert expected <= set(raw["profiles"])
    for name, entry in raw["profiles"].items():
        for key, item in entry.items():
            if isinstance(item, dict):
                src = str(item.get("source", "")).strip()
                assert src, f"{name}.{key} has no source"
                if src in shared:
                    continue
                assert src.startswith(("measured by megatrain bench", "assumption", "estimate", "http")), \
                    f"{name}.{key}: source {src!r} is neither a sources key nor a citation"
        for key in NUMERIC_FIELDS:
            assert key in entry, f"{name} lacks {key}"
    assert "measured by megatrain bench" in load_profiles()["cpu"].sources["peak_fp32_tflops"]


def test_every_profile_charges_a_fixed_cost_per_layer():
    raw = load_raw()
    for name, entry in raw["profiles"].items():
        for key in OVERHEAD_FIELDS[:2]:
            assert key in entry, f"{name} lacks {key}"
        hw = load_profiles()[name]
        assert hw.layer_overhead_fwd_s > 0 and hw.layer_overhead_bwd_s > 0
        if name == "cpu":  # measured through the engine, with the rate from the same fit
            for key in ("layer_overhead_fwd_s", "layer_overhead_bwd_s", "microbatch_overhead_s", "sustained_fp32"):
                assert "measure.layer_overhead" in hw.sources[key], (key, hw.sources[key])
        else:  # GPUs: labelled as an estimate, not dressed as a measurement
            assert raw["sources"][entry["layer_overhead_fwd_s"]["source"]].startswith("estimate")


def test_overhead_fields_default_to_zero_and_refuse_negatives():
    raw = load_raw()["profiles"]["cpu"]
    for key in OVERHEAD_FIELDS:
        raw.pop(key, None)
    hw = get_hardware({**raw, "name": "old-bench-file"})
    assert (hw.layer_overhead_fwd_s, hw.layer_overhead_bwd_s, hw.microbatch_overhead_s) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match=">= 0"):
        get_hardware({**raw, "layer_overhead_bwd_s": {"value": -1e-3, "source": "estimate"}})


def test_fixed_costs_add_per_layer_per_phase_and_per_micro_batch():
    # a compute-bound CPU point (unthrottled emulated link): every layer's forward and backward and each
    # micro-batch's head run back to back on the compute timeline, so the step grows by exactly
    # grad_accum x (L x (o_fwd + o_bwd) + o_mb)
    m = get_preset("small-7m")
    hw0 = get_hardware("cpu").with_(layer_overhead_fwd_s=0.0, layer_overhead_bwd_s=0.0, microbatch_overhead_s=0.0)
    o_f, o_b, o_mb = 2e-3, 5e-3, 9e-3
    hw1 = hw0.with_(layer_overhead_fwd_s=o_f, layer_overhead_bwd_s=o_b, microbatch_overhead_s=o_mb)
    for g in (1, 3):
        p0 = plan(m, 128, 1, g, dtype="float32", hardware=hw0)
        p1 = plan(m, 128, 1, g, dtype="float32", hardware=hw1)
        assert p0.time.bottleneck == p1.time.bottleneck == "compute"
        L = m.num_layers
        assert p1.time.step_s - p0.time.step_s == pytest.approx(g * (L * (o_f + o_b) + o_mb), rel=1e-6)
        assert p1.time.layer.fwd_compute - p0.time.layer.fwd_compute == pytest.approx(o_f)
        assert p1.time.layer.bwd_compute - p0.time.layer.bwd_compute == pytest.approx(o_b)  # once, not per recompute
        assert p1.time.forward_s - p0.time.forward_s == pytest.approx(L * o_f)
        # the same terms in the timeline the planner sets against the engine's trace
        from megatrain.planner.estimate import predicted_timeline

        def busy(hw, kind, point):
            return sum(s["end_s"] - s["start_s"] for s in predicted_timeline(point, hw)
                       if s["stream"] == "compute" and s["kind"] == kind)

        pt = make_point(m, 128, 1, g, "float32")
        assert busy(hw1, "bwd", pt) - busy(hw0, "bwd", pt) == pytest.approx(g * L * o_b)
        assert busy(hw1, "head", pt) - busy(hw0, "head", pt) == pytest.approx(g * o_mb)


def test_fit_layer_overhead_recovers_the_rate_and_fixed_costs_it_was_given():
    # periods made by the planner's own model from a known rate and known fixed costs: the engine fit
    # must return them (fixed costs to the microsecond, the rate to 0.1%)
    from megatrain.metrics.bench import fit_layer_overhead
    from megatrain.planner.step_time import globals_io as _globals_io
    from megatrain.planner.step_time import head_compute as _head_compute
    from megatrain.planner.step_time import layer_compute as _layer_compute

    m = get_preset("small-7m")
    true = get_hardware("cpu").with_(sustained_fp32=0.61, layer_overhead_fwd_s=1.7e-3, layer_overhead_bwd_s=4.2e-3,
                                     microbatch_overhead_s=11e-3)
    periods = []
    for T in (64, 256, 512):
        p = make_point(m, T, 1, dtype="float32")
        f, r, b = _layer_compute(p, true)
        io = _globals_io(p, true)
        periods.append((f, r + b, _head_compute(p, true, True) + io.add_s + io.down_s + true.microbatch_overhead_s))
    start = true.with_(sustained_fp32=0.2, layer_overhead_fwd_s=0.0, layer_overhead_bwd_s=0.0)
    fit = fit_layer_overhead(m, (64, 256, 512), periods, start)
    assert fit["sustained"] == pytest.approx(0.61, rel=1e-3)
    assert fit["overhead_fwd_s"] == pytest.approx(1.7e-3, abs=1e-6)
    assert fit["overhead_bwd_s"] == pytest.approx(4.2e-3, abs=1e-6)
    assert fit["overhead_microbatch_s"] == pytest.approx(11e-3, abs=1e-6)
    assert fit["max_rel_residual"] < 1e-6


def test_profiles_load_and_a_bad_entry_is_refused(tmp_path):
    profiles = load_profiles()
    assert profiles["gh200"].link_gbs_theoretical == 450
    assert profiles["cpu"].unified_memory
    bad = {"profiles": {"x": {"peak_bf16_tflops": {"value": 1}}}}
    f = tmp_path / "hw.yaml"
    f.write_text(yaml.safe_dump(bad))
    with pytest.raises(ValueError, match="source|lacks"):
        load_profiles(f)


# ------------------------------------------------------------------ host memory and preflight


def test_host_memory_available_reads_cgroup_v2_then_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemAvailable:   8000000 kB\n")
    root = tmp_path / "cg"
    (root / "job").mkdir(parents=True)
    proc = tmp_path / "cgroup"
    proc.write_text("0::/job\n")
    # no limit file -> MemAvailable
    hm = host_memory_available(meminfo, root, proc)
    assert hm.available_bytes == 8000000 * 1024 and "MemAvailable" in hm.source
    (root / "job" / "memory.max").write_text(str(4 * GIB) + "\n")
    (root / "job" / "memory.current").write_text(str(1 * GIB) + "\n")
    hm = host_memory_available(meminfo, root, proc)
    assert hm.available_bytes == 3 * GIB and hm.limit_bytes == 4 * GIB and "cgroup" in hm.source
    (root / "job" / "memory.max").write_text("max\n")
    assert host_memory_available(meminfo, root, proc).available_bytes == 8000000 * 1024


def test_host_memory_available_cgroup_v1_unlimited_and_limited(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 1000 kB\nMemAvailable: 900 kB\n")
    root = tmp_path / "cg"
    (root / "memory").mkdir(parents=True)
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/not/mounted/here\n0::/\n")
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (root / "memory" / "memory.usage_in_bytes").write_text("100\n")
    assert host_memory_available(meminfo, root, proc).available_bytes == 900 * 1024
    (root / "memory" / "memory.limit_in_bytes").write_text("500000\n")
    assert host_memory_available(meminfo, root, proc).available_bytes == 500000 - 100
    assert host_memory_available().available_bytes > 0  # this machine


def test_preflight_reports_needed_vs_available():
    ok, reason = preflight("qwen2.5-14b", 4096, 1, "megatrain", "bfloat16",
                           host_available=64 * GIB, device_available=80 * GIB)
    assert not ok
    assert "host: needs" in reason and "64.00 GiB available" in reason and "master weights" in reason
    res = preflight("qwen2.5-14b", 4096, 1, "megatrain", "bfloat16",
                    host_available=512 * GIB, device_available=80 * GIB)
    assert res.ok and res.host_needed < res.host_available and res.device_needed < res.device_available
    # without a device, device allocations are charged to the host
    cpu = preflight("tiny", 256, 1, "megatrain", "float32", host_available=8 * GIB, device_available=None)
    assert cpu.ok and "device shares it" in cpu.reason
    assert not preflight("llama-100m", 512, 2, "zero3", "float32", host_available=256 * 1024**2).ok


# ------------------------------------------------------------------ CLI


def test_cli_plan_prints_breakdown(capsys):
    assert main(["--model", "120b", "--context", "4096", "--batch", "8", "--hardware", H200]) == 0
    out = capsys.readouterr().out
    for needle in ("host memory", "device memory", "fits: NO", "largest micro-batch", "largest context",
                   "tokens/s", "model TFLOPS", "link stops being the bottleneck", "zero3 at the same point",
                   "zero3 from DeepSpeed's mechanisms"):
        assert needle in out, needle


def test_cli_json_bad_name_and_registration(capsys):
    assert main(["plan", "--model", "tiny", "--context", "128", "--hardware", "cpu", "--dtype", "float32",
                 "--json", "--no-search", "--compare", ""]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["fits"] and d["point"]["model"] == "tiny"
    assert main(["--model", "nope", "--hardware", H200]) == 2
    assert "unknown model preset" in capsys.readouterr().err
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers()
    add_plan_parser(sub)
    add_bench_parser(sub)
    args = ap.parse_args(["plan", "--model", "7b", "--offload-activations", "off", "--mlp-tile-tokens", "4096"])
    assert args.offload_activations is False and args.mlp_tile_tokens == 4096 and callable(args.func)
    assert ap.parse_args(["plan", "--model", "7b", "--tile-tokens", "none"]).mlp_tile_tokens is None  # old name
    assert ap.parse_args(["bench", "--quick"]).quick


def test_cli_sweep_writes_predicted_rows(tmp_path):
    # the harness's spec format: defaults, grids (a list is an axis), explicit points
    spec = tmp_path / "sweep.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "t", "defaults": {"precision": "bf16", "micro_batch": 1, "steps": 2},
        "grids": [{"backend": "megatrain", "model": ["7b", "14b"], "seq_len": [4096, 65536],
                   "max_positions": 65536, "engine": {"offload_activations": True}},
                  {"backend": "zero3", "model": "7b", "seq_len": 4096, "micro_batch": [1, 64]}],
        "points": [{"backend": "torch", "model": "nope", "seq_len": 1024}]}))
    out = tmp_path / "rows.csv"
    assert main(["--sweep", str(spec), "--out", str(out), "--hardware", "a100-pcie,gh200"]) == 0
    rows = list(csv.DictReader(open(out)))
    assert len(rows) == 2 * 7 and all(r["source"] == "predicted" for r in rows)
    assert {r["hardware"] for r in rows} == {"a100-pcie", "gh200"}
    mt = [r for r in rows if r["backend"] == "megatrain"]
    assert all(r["offload_activations"] == "True" and r["precision"] == "bf16" for r in mt)
    assert {r["status"] for r in rows if r["backend"] == "zero3"} == {"ok", "skipped"}  # 64 x 4k logits
    bad = [r for r in rows if r["status"] == "failed"]
    assert len(bad) == 2 and "unknown model preset" in bad[0]["reason"]
    for r in rows:
        if r["status"] == "ok":
            assert float(r["tokens_per_s"]) == pytest.approx(int(r["tokens_per_step"]) / float(r["step_time_s"]))


def test_bench_cpu_quick_returns_a_valid_profile():
    from megatrain.metrics.bench import bench_cpu
    from megatrain.planner.hardware import profile_from_dict

    prof = bench_cpu(quick=True, threads=1)
    raw = prof.pop("raw")
    hw = profile_from_dict(prof.pop("name"), prof)
    assert hw.unified_memory and hw.peak_fp32_tflops > 0 and hw.link_gbs_achieved > 0
    assert raw["threads"] == 1
    # the engine's fixed costs are measured (or, where the quick fit fails, 0 and said so)
    for key in ("layer_overhead_fwd_s", "layer_overhead_bwd_s", "microbatch_overhead_s"):
        assert getattr(hw, key) >= 0 and hw.sources[key]
        assert "engine_fit" in raw or hw.sources[key].startswith("assumption: 0")
    # the measured profile plans
    assert plan("tiny", 128, 1, dtype="float32", hardware=hw).time.step_s > 0


def test_cli_bench_writes_a_profile_plan_can_load(tmp_path, capsys):
    out = tmp_path / "me.yaml"
    assert main(["bench", "--quick", "--threads", "1", "--out", str(out), "--name", "mybox"]) == 0
    assert "mybox" in yaml.safe_load(out.read_text())["profiles"]
    capsys.readouterr()
    assert main(["--model", "tiny", "--context", "128", "--dtype", "float32", "--hardware", "mybox",
                 "--hardware-file", str(out), "--no-search", "--compare", ""]) == 0
    assert "on mybox" in capsys.readouterr().out


def test_planner_runs_the_engine_memory_model_without_loading_torch():
    """The planner shares the engine's memory model (costs/memory.py) but must stay a light import:
    planning a point loads neither torch nor transformers."""
    from kit import run_python

    code = ("import sys, megatrain.planner as P; p = P.plan('smollm-135m', 8192, dtype='float32', "
            "backend='megatrain', hardware='cpu'); assert p.long_context.peak_bytes > 0; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = run_python(["-c", code], timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_overlapped_optimizer_hides_behind_the_next_forward():
    # 120B on H200 + PCIe: the optimizer (~15 s) against a ~14 s forward; with overlap only the globals'
    # update and what the layer updates exceed the first micro-batch's forward by remain.
    from megatrain.config.schema import EngineConfig

    m = get_preset("dense-120b")
    whole = plan(m, 4096, batch=8, hardware=H200, optimizer_overlap=False)
    over = plan(m, 4096, batch=8, hardware=H200, optimizer_overlap=True)
    # the engine's own setting carries over, as its other knobs do
    assert plan(m, 4096, hardware=H200, engine_config=EngineConfig(optimizer_overlap=True)).point.optimizer_overlap
    t, L = over.time, m.num_layers
    u = t.optimizer_busy_s * m.layer_params() / m.param_count()  # one layer's share of the update
    globals_s = t.optimizer_busy_s - L * u
    assert t.optimizer_s == pytest.approx(globals_s + max(L * u - t.forward_s + t.forward_s / L, u), rel=1e-9)
    assert whole.time.optimizer_s == pytest.approx(whole.time.optimizer_busy_s)
    assert t.step_s == pytest.approx(whole.time.step_s - (whole.time.optimizer_s - t.optimizer_s), rel=1e-9)
    assert t.step_s < 0.85 * whole.time.step_s


def test_cli_plan_120b_on_h200_lists_the_modes_and_an_exact_one_fits(capsys):
    """The paper's headline point: the default does not fit 1.5 TiB; the exact hilo master with the optimizer in
    backward (which the engine runs, tests/integration/test_host_modes.py) does, and so does the paper's inexact bf16 mode."""
    assert main(["--model", "120b", "--context", "4096", "--batch", "8", "--hardware", H200]) == 0
    out = capsys.readouterr().out
    rows = {line.split("  ")[2].strip(): line for line in out.splitlines() if line.startswith("    ") and
            ("master," in line)}
    assert " NO " in rows["fp32 master, fp32 grads"]
    exact_fit = rows["hilo master, optimizer in backward"]
    assert " yes " in exact_fit and exact_fit.split()[5] == "yes" and "dense-120b" in exact_fit
    assert "no clipping" in exact_fit
    paper = rows["bf16 master, bf16 grads (paper's code)"]
    assert paper.split()[6] == "no"  # not exact, and said so


def test_mode_table_refuses_what_the_engine_refuses():
    from megatrain.planner.hardware import resolve_hardware as _hardware
    from megatrain.planner.mode_table import mode_table
    from megatrain.planner.point import make_point

    rows = {r.label: r for r in mode_table(make_point("llama2-7b", 1024, 1, 2, "bfloat16", "megatrain"),
                                            _hardware(H200, None, None, None), search=False)}
    assert "accumulation" in rows["hilo master, optimizer in backward"].refused
    assert not rows["hilo master, optimizer in backward"].fits
    assert rows["hilo master, fp32 grads"].refused is None and rows["hilo master, fp32 grads"].fits
