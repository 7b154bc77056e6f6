"""The GPU check's 2-GPU phase (experiments/gpu_check/dp2.py): it is in the phase list before the bench, it skips
with its reason where fewer than two GPUs are visible, and its check, run on gloo ranks standing in for the GPUs,
finds the node path's two ranks at one process's losses and about half a lone rank's link bytes."""

from __future__ import annotations

import json
import math

import pytest
from kit import ROOT

import experiments.gpu_check as gc
from experiments.gpu_check import dp2
from experiments.gpu_check.common import Ctx

WORKERS = ROOT / "tests" / "workers"


def test_the_phase_list_runs_dp2_before_the_bench():
    names = [p.name for p in gc.PHASES]
    assert "dp2" in names and names.index("dp2") < names.index("bench")
    assert gc.PHASE_FNS["dp2"] is dp2.phase_dp2
    assert not next(p for p in gc.PHASES if p.name == "dp2").optional  # runs in the one prepared run


@pytest.mark.parametrize("found", [0, 1])
def test_skips_saying_so_with_fewer_than_two_devices(tmp_path, found, monkeypatch):
    import torch

    assert dp2.skip_reason(found) == f"needs 2 GPUs (found {found})"
    assert dp2.skip_reason(2) is None
    ctx = Ctx("dp2", tmp_path, dry=False, deadline=1e12)
    monkeypatch.setattr(ctx, "cuda", found > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: found)
    dp2.phase_dp2(ctx)
    ctx.finish()
    rec = json.loads((tmp_path / "phases" / "dp2.json").read_text())
    assert rec["status"] == "skipped" and rec["reason"] == f"needs 2 GPUs (found {found})", rec
    assert rec["checks"] == {} and rec["info"]["gpus"] == found


@pytest.mark.slow
def test_gloo_pair_matches_one_process_at_half_the_link_bytes(tmp_path):
    res = dp2.run_node_pair(tmp_path, "cpu", timeout_s=300)
    assert res["data_path"].startswith("node:") and res["backend"] == "gloo", res
    assert res["loss_gap_fp32"] <= dp2.TOL, res
    for rank, share in res["link_share_per_step"].items():
        assert 0 < share["h2d_bytes"] <= dp2.MAX_LINK_SHARE and 0 < share["d2h_bytes"] <= dp2.MAX_LINK_SHARE, rank
    assert res["ok"], res


@pytest.mark.slow
def test_gloo_pair_without_the_all_gather_fails_the_check(tmp_path):
    """The negative control: ranks whose layers hold only their own shard (the rest never written: NaN losses here)
    train another model; the check says so."""
    res = dp2.run_node_pair(tmp_path, "cpu", timeout_s=300, rank_worker=WORKERS / "dp2_skip_gather.py")
    gap = res["loss_gap_fp32"]
    assert not res["ok"] and not gap <= dp2.TOL and (math.isnan(gap) or gap > 100 * dp2.TOL), gap


def test_the_summary_carries_the_pairs_figures(tmp_path):
    from experiments.gpu_check.summary import build_summary, render_markdown

    check = {"ok": False, "backend": "nccl", "loss_gap_fp32": 3e-5, "tol": dp2.TOL, "max_link_share": 0.6,
             "link_share_per_step": {"rank0": {"h2d_bytes": 0.503, "d2h_bytes": 0.503},
                                     "rank1": {"h2d_bytes": 0.497, "d2h_bytes": 0.497}}}
    s = build_summary(tmp_path, {"dp2": {"phase": "dp2", "status": "failed",
                                         "checks": {"node_path_two_gpus": check}}}, dry=False)
    assert s["figures"]["dp2"]["loss_gap_fp32"] == 3e-5 and s["figures"]["dp2"]["ok"] is False
    md = render_markdown(s)
    assert "## Node path on two GPUs" in md and "rank0 h2d 0.503x" in md and "3e-05" in md and "ok no" in md
