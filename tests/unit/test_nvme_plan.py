"""The NVMe tier in `megatrain plan` (planner/nvme_plan.py): dense-120b, exact and clipped, fits a 1.5 TiB host
plus NVMe on h200-pcie with a predicted step time; the disk rate is the profile's assumed figure, named as such,
or the --nvme-gbs override; a profile without one plans no tier and says how to give it."""

from __future__ import annotations

import pytest

from megatrain.commands import cli
from megatrain.costs.nvme import io_seconds
from megatrain.planner.estimate import plan
from megatrain.planner.hardware import get_hardware
from megatrain.planner.memory import fmt_bytes
from megatrain.planner.nvme_plan import nvme_rows, with_nvme

EXACT_CLIPPED = "hilo master, bf16 grads"


@pytest.fixture(scope="module")
def point():
    return plan("120b", 4096, 8, hardware="h200-pcie").point


def test_dense_120b_exact_with_clipping_fits_1_5_tib_plus_nvme(point):
    hw = get_hardware("h200-pcie")
    assert "assumption" in hw.sources["nvme_gbs"] and hw.nvme_gbs > 0  # an assumed figure, named as such
    rows = {r.label: r for r in nvme_rows(point, hw, search=False)}
    r = rows[EXACT_CLIPPED]
    assert r.exact and not r.fits_without and r.fits  # host alone: no; with the tier: yes
    assert r.host_bytes <= hw.host_bytes < plan("120b", 4096, 8, hardware="h200-pcie", master="hilo",
                                                   host_grad_dtype="bfloat16").memory.host_total
    assert 0 < r.spilled < r.layers and r.disk_bytes > 0
    base = plan("120b", 4096, 8, hardware="h200-pcie", master="hilo", host_grad_dtype="bfloat16").time.step_s
    assert r.step_s == pytest.approx(base + r.added_s) and r.added_s > 0
    # every spilled byte read and written once per step at the disk's rate
    assert r.io_s == pytest.approx(io_seconds(r.spilled * point.model.layer_params(), True, hw.nvme_gbs), rel=1e-6)
    assert all(not x.knobs["optimizer_in_backward"] for x in rows.values())  # the modes that clip


def test_nvme_gbs_override_and_a_profile_without_a_disk(point):
    hw = get_hardware("h200-pcie")
    fast, slow = (nvme_rows(point, with_nvme(hw, g, None), search=False) for g in (40.0, 2.0))
    f, s = (next(r for r in rows if r.label == EXACT_CLIPPED) for rows in (fast, slow))
    assert s.io_s == pytest.approx(20 * f.io_s) and s.step_s > f.step_s
    nodisk = nvme_rows(point, hw.with_(nvme_gbs=None), search=False)
    assert all(not r.fits and "--nvme-gbs" in r.why for r in nodisk if not r.fits_without)
    tiny = next(r for r in nvme_rows(point, with_nvme(hw, None, 10.0), search=False) if r.label == EXACT_CLIPPED)
    assert not tiny.fits and "of disk" in tiny.why  # 10 GiB of disk cannot hold the spilled state


def test_plan_command_prints_the_tier(capsys):
    assert cli.main(["plan", "--model", "120b", "--context", "4096", "--batch", "8", "--hardware", "h200-pcie",
                     "--compare", "", "--no-search", "--nvme-gbs", "20", "--details"]) == 0
    out = capsys.readouterr().out
    tier = out[out.index("NVMe tier"):]
    line = next(x for x in tier.splitlines() if x.strip().startswith(EXACT_CLIPPED + " + NVMe"))
    assert " yes " in line and "/96" in line
    assert '"nvme_path": "/path/on/nvme", "host_budget_bytes"' in out


def test_plan_json_carries_the_tier(capsys):
    import json

    assert cli.main(["plan", "--model", "120b", "--context", "4096", "--batch", "8", "--hardware", "h200-pcie",
                     "--compare", "", "--no-search", "--json"]) == 0
    out = capsys.readouterr().out
    tier = json.loads(out)["nvme"]
    row = next(r for r in tier if r["label"] == EXACT_CLIPPED)
    assert row["fits"] and not row["fits_without"] and row["spilled"] > 0


def test_405b_names_the_part_that_never_spills_and_the_least_host_that_fits():
    """Llama-3.1-405B on a 1.5 TiB host: masters, gradients and the bf16 shadow (which never spill: ~3.7 TiB) are
    what exceed the host, not one layer's working set; the row says so and gives the least host that trains."""
    from megatrain.models.presets import ModelPreset
    from megatrain.planner.hardware import GIB

    m = ModelPreset("llama3.1-405b", "llama", 126, 16384, 53248, 128, 8, 128256, 131072, rope_theta=5e5)
    hw = get_hardware("h200-pcie")
    p = plan(m, 4096, 1, hardware=hw).point
    rows = {r.label: r for r in nvme_rows(p, hw, search=False)}
    r = rows["fp32 master, fp32 grads"]
    assert not r.fits and "what never spills (master weights, gradients, bf16 shadow: 3.71 TiB)" in r.why
    assert "one layer" not in r.why and f"needs at least {fmt_bytes(r.min_host_bytes)} of host memory" in r.why
    assert 3.7 * 2**40 < r.min_host_bytes < 3.9 * 2**40
    # the least host is exact: with it the tier plans (every layer spilled), a GiB less and it cannot
    at_least = next(x for x in nvme_rows(p, hw.with_(host_memory_gib=r.min_host_bytes / GIB), search=False)
                    if x.label == r.label)
    assert at_least.fits and at_least.spilled == r.layers
    below = next(x for x in nvme_rows(p, hw.with_(host_memory_gib=r.min_host_bytes / GIB - 1), search=False)
                 if x.label == r.label)
    assert not below.fits and "one layer's spilled state" in below.why  # what never spills fits; one buffer not
    # hi/lo keeps only the hi half of its master in host memory
    hl = rows["hilo master, bf16 grads"]
    assert "master weights (the hi half)" in hl.why and hl.min_host_bytes < r.min_host_bytes
