"""The planner chooses host mode "auto" through the library's one settle function, the engine's (config/settle.py
settle_host_mode over HostFacts), with its own byte model as `fits`: a plan and a run cannot choose apart. The
control changes the rule inside config/settle.py and watches the planner follow it (it had a copy of the call)."""

from __future__ import annotations

import pytest

from megatrain.config import settle
from megatrain.costs.host_mode import HostMode, candidates
from megatrain.costs.modes import GradSlab, HostMaster
from megatrain.planner import plan, plan_multi

FP32 = HostMode(HostMaster.FP32, GradSlab.FLOAT32)
HILO = HostMode(HostMaster.HILO, GradSlab.FLOAT32)


def _mode(pl) -> HostMode:
    return pl.auto.mode


def test_the_plans_choice_is_the_settle_functions(monkeypatch):
    calls = []
    real = settle.choose_host_mode

    def spy(fits, *args, **kw):
        mode, ok = real(fits, *args, **kw)
        calls.append((mode, ok, args))
        return mode, ok

    monkeypatch.setattr(settle, "choose_host_mode", spy)
    pl = plan("120b", 2048, batch=8, hardware="h200-pcie")
    assert calls, "the planner did not settle through config/settle.py"
    mode, ok, args = calls[-1]
    assert _mode(pl) == mode and pl.auto.fits == ok
    # the arguments the engine's settle passes: bf16 compute, one micro-batch, the NVMe tier offered (the profile's
    # disk, as a set nvme_path), no optimizer in backward, the slab dtype left to the rule
    assert args == (True, True, True, False, None)
    assert pl.auto.verdict.startswith("yes, exact, hilo + bf16 slabs + NVMe")  # the README's answer


@pytest.mark.parametrize("multi", [False, True])
def test_a_changed_rule_moves_the_plan(monkeypatch, multi):
    """Control: a rule that prefers hilo over the FP32 master (where both fit) in config/settle.py is the planner's
    rule too, single GPU and node alike."""
    def run():
        if multi:
            return plan_multi("qwen2.5-7b", 4096, gpus_per_node=2, hardware="h200-sxm").auto.mode
        return _mode(plan("qwen2.5-7b", 4096, hardware="h200-sxm"))

    assert run() == FP32

    def hilo_first(fits, *args, **kw):
        tried = candidates(*args, **kw)
        tried = [m for m in tried if m == HILO] + [m for m in tried if m != HILO]
        for mode in tried:
            if fits(mode):
                return mode, True
        return tried[-1], False

    monkeypatch.setattr(settle, "choose_host_mode", hilo_first)
    assert run() == HILO


def test_fp32_compute_leaves_no_mode_to_choose_but_the_tier():
    """FP32 compute: the settings hold the FP32 master at once (the engine's settle has nothing to choose); the
    plan spills to the profile's NVMe only where the host-only store does not fit, as the engine's spill would."""
    small = plan("qwen2.5-7b", 2048, hardware="h200-pcie", dtype="float32")
    assert _mode(small) == FP32 and small.auto.fits
    big = plan("120b", 2048, hardware="h200-pcie", dtype="float32", host_memory_gib=1024)
    assert _mode(big) == HostMode(HostMaster.FP32, GradSlab.FLOAT32, True)
