"""The planner's timeline counts the resident masters' rounding as the engine runs it (engine/host/resident_upload.py):
on a worker of its own, fenced by an event the next forward's embedding waits for. The launch thread is charged
the resident update only; the rounding is the worker's busy time, and the device's wait for it, with overlap on
(beside the layer updates, sharing the host's bandwidth) as with it off (after them)."""

from __future__ import annotations

import pytest

from megatrain.costs.residency import Residency
from megatrain.planner import host_work as hwork
from megatrain.planner import plan
from megatrain.planner.hardware import get_hardware
from megatrain.planner.host_rates import HOST_RATES
from megatrain.planner.step_time import IDLE_RESIDENT, IDLE_ROUND
from megatrain.planner.step_timeline import LAUNCH, ROUNDING, SERIAL

M14 = "qwen2.5-14b"


@pytest.mark.parametrize("overlap", [True, False])
def test_the_rounding_is_its_workers_time_not_the_launch_threads(overlap):
    hw = get_hardware("h200-pcie")
    # every layer streamed, no optimizer on the device: the resident parameters update and round on the host
    pl = plan(M14, 4096, batch=8, hardware=hw, optimizer_overlap=overlap, residency=Residency())
    m, t, tl = pl.point.model, pl.time, pl.timeline
    resident = m.param_count() - m.num_layers * m.layer_params()
    rounding = resident * (4 + 2) / hw.host_bw_bps * HOST_RATES["resident rounding"].x_bound
    assert SERIAL not in tl.host_busy_s  # no one thread runs both
    assert rounding > 0 and tl.host_busy_s[ROUNDING] == pytest.approx(rounding)
    assert tl.host_busy_s[LAUNCH] == pytest.approx(t.idle_s[IDLE_RESIDENT])  # the update alone
    # the forward's embedding waits for the worker: the device idles for it, and the causes still add up
    assert tl.idle_s[IDLE_ROUND] == pytest.approx(rounding)
    assert sum(tl.idle_s.values()) == pytest.approx(tl.step_s - tl.gpu_busy_s, rel=1e-9)
    work = hwork.serial_work(pl.point, hw, resident, t.idle_s[IDLE_RESIDENT])
    assert work.launch_thread_s == pytest.approx(tl.host_busy_s[LAUNCH])
    assert work.total_s == pytest.approx(tl.host_busy_s[LAUNCH] + tl.host_busy_s[ROUNDING])


def test_nothing_to_round_charges_the_worker_nothing():
    # FP32 compute uploads the masters (the resident parameters' optimizer on the host: no layer's on the device)
    pl = plan(M14, 4096, batch=8, hardware="h200-pcie", dtype="float32", residency=Residency())
    assert pl.timeline.host_busy_s[ROUNDING] == 0 and pl.timeline.idle_s[IDLE_ROUND] == 0
    assert pl.timeline.host_busy_s[LAUNCH] > 0
