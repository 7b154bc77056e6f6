"""The `fits` benchmark steps plain PyTorch and the engine in two processes in lockstep and pairs their steps."""

import math

import pytest

from experiments.studies import engine_bench


@pytest.mark.slow
def test_paired_fits_bench_steps_both_processes_in_lockstep() -> None:
    res = engine_bench.bench_fits("tiny", seq=32, batch=2, steps=3, warmup=1, settle_s=0.0)
    torch_run, eng_run = res["runs"]["torch"], res["runs"]["megatrain"]
    assert len(torch_run["step_s"]) == len(eng_run["step_s"]) == 3
    # Same seed, same batch: the two backends train the same model, so their losses agree step by step
    # (a process that skipped or repeated a step would be a step apart from here on).
    for a, b in zip(torch_run["losses"], eng_run["losses"]):
        assert math.isclose(a, b, rel_tol=1e-5)
    assert torch_run["losses"][0] > torch_run["losses"][-1]  # it trains: both processes really stepped
    assert res["paired_ratios"] == [m / t for m, t in zip(eng_run["step_s"], torch_run["step_s"])]
    assert res["paired_ratio_quartiles"][0] <= res["paired_ratio_median"] <= res["paired_ratio_quartiles"][1]
    for run in (torch_run, eng_run):  # the three phases make up each step
        assert all(math.isclose(sum(p), t) for p, t in zip(run["phases_s"], run["step_s"]))
    assert eng_run["recomputed_layers"] == 0 and eng_run["h2d_bytes"] == 0  # the engine's defaults: all fits
