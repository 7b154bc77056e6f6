"""`megatrain plan`'s GPU-idle causes name the thread that does the resident work, as the engine runs it: the
resident parameters' update on the launch thread once the layer jobs are queued, their rounding into the bf16
upload staging on a worker of its own that the next forward waits for (engine/host/resident_upload.py) - not
"serial" work, which would send a reader looking for it on the launch thread."""

from __future__ import annotations

from megatrain.costs.residency import Residency
from megatrain.planner import plan
from megatrain.planner.step_time import IDLE_RESIDENT, IDLE_ROUND
from megatrain.planner.step_timeline import LAUNCH, ROUNDING, format_timeline


def test_the_printed_idle_causes_name_the_rounding_worker_and_the_launch_thread():
    # bf16 compute on CUDA, no optimizer on the device (the resident parameters' on the host): both terms present
    pl = plan("qwen2.5-14b", 4096, batch=8, hardware="h200-pcie", residency=Residency())
    t = pl.time
    assert t.idle_s[IDLE_ROUND] > 0 and t.idle_s[IDLE_RESIDENT] > 0
    causes = next(ln for ln in format_timeline(pl.timeline) if "GPU idle by cause" in ln)
    assert IDLE_ROUND in causes and IDLE_RESIDENT in causes
    assert "serial" not in IDLE_ROUND and "serial" not in IDLE_RESIDENT
    # the same threads the host busy split names (step_timeline.py)
    assert "its worker" in IDLE_ROUND and "its worker" in ROUNDING
    assert "launch thread" in IDLE_RESIDENT and "launch thread" in LAUNCH
    assert "the forward waits" in IDLE_ROUND
