"""The planner's DeepSpeed ZeRO-3/ZeRO-2 offload model (megatrain/planner/zero3_model.py, step_time.zero3_time)
and the fit of its constants (experiments/studies/zero3_mechanisms_validate.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from megatrain.planner import get_hardware, plan
from megatrain.planner.zero3_model import (
    MAX_ONGOING_FETCH_EVENTS,
    Step,
    decoder_layer_submodules,
    offload_tuning,
    run_pass,
)

REPO = Path(__file__).resolve().parents[2]
GB = 1e9


def test_no_fetches_no_hooks_is_the_compute():
    steps = [Step(0, 0.5), Step(0, 0.25), Step(0, 1.0)]
    assert run_pass(steps, 2, GB, 0.0, 10**9).seconds == pytest.approx(1.75)
    assert run_pass(steps, 2, GB, 0.0, 10**9, overlap=False).seconds == pytest.approx(1.75)


def test_fetches_hide_behind_the_compute_before_them():
    # module j's fetch (1 s) is shorter than module j-1's compute (2 s): only the first is exposed;
    # serialized (DeepSpeed's worst case, and any CPU device), every fetch adds
    steps = [Step(500_000_000, 2.0) for _ in range(4)]  # 0.5e9 elements x 2 B at 1 GB/s = 1 s each
    ahead = run_pass(steps, 2, GB, 0.0, prefetch_bucket=10**9)
    assert ahead.seconds == pytest.approx(1.0 + 4 * 2.0)
    serial = run_pass(steps, 2, GB, 0.0, prefetch_bucket=10**9, overlap=False)
    assert serial.seconds == pytest.approx(4 * (1.0 + 2.0))  # negative control
    assert ahead.fetch_s == serial.fetch_s == pytest.approx(4.0)


def test_host_hooks_and_device_compute_overlap_on_a_gpu_and_add_on_a_cpu():
    # the host's per-module Python runs while the device computes the module before: a host-bound
    # pass lasts n hooks (+ the last compute); serialized (a CPU device) hooks and compute add
    n = 100
    steps = [Step(0, 0.5e-3) for _ in range(n)]
    assert run_pass(steps, 2, GB, 1e-3, 10**9).seconds == pytest.approx(n * 1e-3 + 0.5e-3)
    assert run_pass(steps, 2, GB, 1e-3, 10**9, overlap=False).seconds == pytest.approx(n * 1.5e-3)


def test_a_large_module_is_prefetched_although_it_exceeds_the_bucket():
    # DeepSpeed queues at least one parameter per prefetch, however large
    steps = [Step(1000, 2.0), Step(10**9, 1.0)]
    t = run_pass(steps, 1, GB, 0.0, prefetch_bucket=10)
    assert t.seconds == pytest.approx(1000 / GB + max(2.0, 1.0) + 1.0)


def test_the_host_cannot_run_further_ahead_than_the_event_limit():
    # fetch-bound modules with no compute: the host's hooks wait for the fetches it is more than
    # MAX_ONGOING_FETCH_EVENTS behind, so the pass lasts as long as the copy lane, whatever the hooks
    n = 10
    steps = [Step(10**9, 0.0) for _ in range(n)]
    t = run_pass(steps, 1, GB, 1e-6, prefetch_bucket=10**12)
    assert t.seconds == pytest.approx(n * 1.0, rel=1e-6)
    assert MAX_ONGOING_FETCH_EVENTS == 2


def test_a_decoder_layer_has_the_modules_deepspeed_hooks():
    mods = decoder_layer_submodules(4096, 1024, 14336, qkv_bias=False, attention_share=0.1)
    assert len(mods) == 13  # layer, 2 norms, attention + 4 projections, MLP + 3 projections, activation
    assert sum(m.compute_share for m in mods) == pytest.approx(1.0)
    params = sum(sum(m.params) for m in mods)
    assert params == 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    # the zero3 backend's documented tuning and the planner's are the same formulas
    from baselines.zero3 import hidden_size_tuning

    assert offload_tuning(5120) == hidden_size_tuning(5120)


def _cpu(**changes):
    return get_hardware("cpu").with_(**changes)


def test_on_a_cpu_device_every_hook_adds_to_the_step():
    # no asynchronous device: hooks serialize with compute, so each second of hook cost is a second
    # of step; module visits per micro-batch = (forward + recompute + backward) x (13 x layers + head/embed)
    base = plan("small-7m", 128, dtype="float32", hardware=_cpu(zero3_module_hook_s=1e-3), backend="zero3")
    more = plan("small-7m", 128, dtype="float32", hardware=_cpu(zero3_module_hook_s=2e-3), backend="zero3")
    visits = 3 * 13 * 4 + 5  # + embedding, final norm, head forward; head, embedding backward
    assert more.time.step_s - base.time.step_s == pytest.approx(visits * 1e-3, rel=1e-9)


def test_cpu_adam_is_charged_at_the_profiles_rate_after_backward():
    m = "llama-100m"
    slow = plan(m, 128, dtype="float32", hardware=_cpu(cpu_adam_params_per_s=1e8), backend="zero3", grad_clip=False)
    fast = plan(m, 128, dtype="float32", hardware=_cpu(cpu_adam_params_per_s=2e8), backend="zero3", grad_clip=False)
    from megatrain.models.presets import get_preset

    P = get_preset(m).param_count()
    assert slow.time.optimizer_s == pytest.approx(P / 1e8)
    assert slow.time.step_s - fast.time.step_s == pytest.approx(P / 1e8 - P / 2e8)


def test_zero2_keeps_parameters_on_the_device_and_uploads_them_after_the_step():
    z3 = plan("llama3.1-8b", 2048, 4, hardware="h200-pcie", backend="zero3")
    z2 = plan("llama3.1-8b", 2048, 4, hardware="h200-pcie", backend="zero3", zero_stage=2)
    from megatrain.models.presets import get_preset

    P = get_preset("llama3.1-8b").param_count()
    assert z2.time.h2d_bytes == 2 * P  # only the updated bf16 parameters after the optimizer
    assert z3.time.h2d_bytes > 2 * P  # every submodule fetched in forward, recompute and backward
    assert z2.time.busy_s["host hooks"] < z3.time.busy_s["host hooks"]
    with pytest.raises(ValueError, match="zero_stage=1"):
        plan("llama3.1-8b", 2048, hardware="h200-pcie", backend="zero3", zero_stage=1)


def test_fit_recovers_known_constants():
    """The fitting code, on synthetic microbenchmark rows made from known constants (parity);
    negative control: other constants give another fit."""
    from experiments.studies.zero3_mechanisms_validate import fit_constants

    def rows(hook, grad, flush, elem):
        out = []
        for k, d, rb in [(8, 128, None), (32, 512, None), (8, 1024, None), (32, 128, 5e8), (32, 1024, 5e8)]:
            n = d * d
            rb = rb or n
            per_call = grad + (flush + elem * n if rb <= n else 0.0)
            out.append({"modules": k, "module_params": n, "reduce_bucket": rb, "threads": 1,
                        "fetch_sub_module_s": (2 * k + 2) * 1e-4, "fetch_sub_module_n": 2 * k + 2,
                        "release_sub_module_s": 2 * k * 1e-4, "release_sub_module_n": 2 * k,
                        "reduce_independent_p_g_buckets_and_remove_grads_s": k * per_call,
                        "reduce_independent_p_g_buckets_and_remove_grads_n": k})
        return pd.DataFrame(out)

    hook = 5e-4
    hf = pd.DataFrame({"layers": [2, 8, 24], "modules": [6 + 13 * n for n in (2, 8, 24)],
                       "zero3_fwd_s": [1 + 13 * hook * n for n in (2, 8, 24)], "plain_fwd_s": [1.0] * 3,
                       "zero3_bwd_s": [2.0] * 3, "plain_bwd_s": [1.0] * 3})
    adam = pd.DataFrame({"params": [1 << 20, 1 << 24, 1 << 24], "deepspeed_cpu_adam_params_per_s": [9e9, 4e8, 6e8],
                         "torch_fused_adamw_params_per_s": [1e9, 3e8, 3e8]})
    c = fit_constants(rows(hook, 6e-5, 1e-3, 2e-8), adam, hf)
    assert c["zero3_module_hook_s"] == pytest.approx(5e-4)
    assert c["zero3_param_grad_hook_s"] == pytest.approx(6e-5)
    assert c["zero3_bucket_flush_s"] == pytest.approx(1e-3)
    assert c["zero3_grad_elem_s"] == pytest.approx(2e-8)
    assert c["cpu_adam_params_per_s"] == pytest.approx(5e8)  # median over the runs at the largest size
    other = fit_constants(rows(5e-4, 6e-5, 3e-3, 2e-8), adam, hf)
    assert not np.isclose(other["zero3_bucket_flush_s"], c["zero3_bucket_flush_s"])


def test_recorded_fit_is_what_the_cpu_profile_carries():
    import json

    fit = json.loads((REPO / "results" / "zero3_mechanisms" / "fit.json").read_text())
    hw = get_hardware("cpu")
    for key in ("zero3_module_hook_s", "zero3_param_grad_hook_s", "zero3_bucket_flush_s", "zero3_grad_elem_s",
                "cpu_adam_params_per_s"):
        assert getattr(hw, key) == pytest.approx(fit[key], rel=0.01), key


def test_published_points_carry_held_out_errors():
    df = pd.read_csv(REPO / "results" / "published" / "published.csv")
    zero = df[df["planner_backend"] == "zero3"]
    assert len(zero) >= 2
    assert zero["error_pct"].notna().all() and zero["loo_error_pct"].notna().all()
    assert (zero["fit_or_heldout"] == "held out").all()
    assert zero["flop_convention"].str.len().gt(0).all()
    adam = df[df["metric"] == "optimizer step"]
    assert set(adam["fit_or_heldout"]) == {"fit", "held out"}
    # sources cite the papers and pages themselves, never notes outside the project
    assert not df["source"].str.contains("Anchors|shared/|as quoted", regex=True).any()
