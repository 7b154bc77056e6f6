"""The planner says what the engine will do: optimizer_overlap "auto" as the engine resolves it and kept out of the
printed config section, the reducer and the launch thread's serial work counted, and the step's timeline with the
GPU idle fraction and its cause (megatrain/planner/step_timeline.py, host_work.py)."""

from __future__ import annotations

import json

import pytest
import torch
from plan_cli import main  # --details: the tables these tests read

from megatrain.config.schema import EngineConfig
from megatrain.config.settle import EngineFacts, settle_engine
from megatrain.costs.residency import Residency
from megatrain.engine import optimizer_fact
from megatrain.engine.runtime.stream import side_threads
from megatrain.planner import host_work as hwork
from megatrain.planner import plan
from megatrain.planner.hardware import get_hardware
from megatrain.planner.host_rates import HOST_RATES
from megatrain.planner.step_time import IDLE_REDUCER, IDLE_RESIDENT, IDLE_ROUND

M14 = "qwen2.5-14b"
CLI = ["plan", "--model", M14, "--context", "4096", "--no-search", "--compare", ""]


@pytest.mark.parametrize("hardware", ["h200-pcie", "gh200", "cpu"])
@pytest.mark.parametrize("in_backward", [False, True])
def test_overlap_auto_is_what_the_engine_resolves(hardware, in_backward):
    hw = get_hardware(hardware)
    knobs = dict(optimizer_in_backward=True, grad_clip=False, master="hilo") if in_backward else {}
    pl = plan(M14, 4096, hardware=hardware, dtype="bfloat16", **knobs)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    device = "cpu" if hw.unified_memory else "cuda"
    engine = settle_engine(EngineConfig(optimizer_in_backward=in_backward), EngineFacts(device, optimizer_fact(opt)))[0]
    assert pl.time.optimizer_overlap == engine.optimizer_overlap
    assert pl.timeline.optimizer_overlap == pl.time.optimizer_overlap
    assert pl.point.optimizer_overlap is None  # the request stays "auto"


def _section(out: str) -> dict:
    line = next(ln for ln in out.splitlines() if "config section for this plan" in ln)
    return json.loads(line.split(": ", 1)[1])


def test_the_printed_section_keeps_the_engines_overlap_default(capsys):
    assert main([*CLI, "--batch", "8", "--hardware", "h200-pcie"]) == 0
    out = capsys.readouterr().out
    section = _section(out)
    assert "optimizer_overlap" not in section
    assert EngineConfig.from_dict(section).optimizer_overlap is None  # the engine resolves it itself
    assert "optimizer_overlap on (as the engine resolves it)" in out
    assert main([*CLI, "--batch", "8", "--hardware", "h200-pcie", "--json"]) == 0
    assert "optimizer_overlap" not in json.loads(capsys.readouterr().out)["settings"]
    # set on the command line, the section says so: the plan needs it
    for flag, want in ((["--optimizer-overlap", "off"], False), (["--optimizer-overlap"], True)):
        assert main([*CLI, "--batch", "8", "--hardware", "h200-pcie", *flag]) == 0
        assert _section(capsys.readouterr().out)["optimizer_overlap"] is want


def test_a_bad_overlap_value_is_refused_by_name():
    with pytest.raises(ValueError, match="optimizer_overlap='sometimes'"):
        plan(M14, 4096, hardware="h200-pcie", optimizer_overlap="sometimes")


@pytest.mark.parametrize("hardware", ["h200-pcie", "gh200"])
@pytest.mark.parametrize("batch", [1, 8])
def test_plan_prints_and_emits_the_gpu_idle_fraction_and_the_reducer(hardware, batch, capsys):
    assert main([*CLI, "--batch", str(batch), "--hardware", hardware]) == 0
    text = capsys.readouterr().out
    assert "GPU idle" in text and "most from:" in text and "    reducer: " in text
    assert main([*CLI, "--batch", str(batch), "--hardware", hardware, "--json"]) == 0
    tl = json.loads(capsys.readouterr().out)["timeline"]
    # at 8 x 4096 the resident parameters' and most layers' optimizer on the device leave the GPU no idle predicted
    assert (0 < tl["gpu_idle_fraction"] < 1) if batch == 1 else (0 <= tl["gpu_idle_fraction"] < 1)
    if tl["gpu_idle_fraction"] == 0:
        assert tl["idle_cause"] == "none"
    else:
        assert tl["idle_cause"] in tl["idle_s"]
        assert tl["idle_s"][tl["idle_cause"]] == max(tl["idle_s"].values())
    assert set(tl["link_busy_s"]) == {"h2d", "d2h"} and "reducer" in tl["host_busy_s"]
    assert tl["reducer"]["threads"] == side_threads(hwork.host_cores(get_hardware(hardware)))
    assert f"GPU idle {tl['gpu_idle_fraction']:.1%}" in text


@pytest.mark.parametrize("hardware,kw", [("h200-pcie", dict(batch=1)), ("h200-pcie", dict(batch=2, grad_accum=3)),
                                         ("gh200", dict(batch=8)), ("cpu", dict(batch=1, dtype="float32")),
                                         ("h200-pcie", dict(batch=8, optimizer_overlap=False))])
def test_the_idle_causes_add_up_to_the_step_less_the_compute(hardware, kw):
    pl = plan("qwen2.5-7b", 4096, hardware=hardware, **kw)
    tl = pl.timeline
    assert sum(tl.idle_s.values()) == pytest.approx(tl.step_s - tl.gpu_busy_s, rel=1e-9)
    assert tl.gpu_idle_fraction == pytest.approx(1 - pl.time.busy_s["compute"] / pl.time.step_s)


def test_the_reducer_runs_on_a_quarter_of_the_cores_and_paces_a_short_backward(monkeypatch):
    hw = get_hardware("h200-pcie")
    short = plan(M14, 4096, batch=1, hardware=hw)
    r = short.timeline.reducer
    # as the engine runs it: side_threads() of the host's cores, c + 8 bytes per parameter per micro-batch
    assert r.threads == side_threads(hwork.host_cores(hw)) and r.bytes_per_param == 2 + 8
    share = min(1.0, r.threads / (hwork.host_cores(hw) * hwork.SATURATING_SHARE),
                r.threads / (r.threads + hwork.globals_threads(hw)))  # beside the globals' worker
    bound = short.point.model.layer_params() * 10 / (hw.host_bw_bps * share)
    # the one-pass kernel (FP32 slabs; its chunks split over the reducer's threads): 0.8x its bound measured on one
    # core, held at the bound on the reducer's 28 (host_work.bounded_bps)
    assert r.per_layer_s == pytest.approx(bound * max(1.0, HOST_RATES["reducer, one pass"].x_bound))
    assert r.per_layer_s > r.per_layer_backward_s  # at 4k tokens the host's add outlasts the layer's backward
    assert short.time.idle_s[IDLE_REDUCER] > 0
    long = plan(M14, 4096, batch=8, hardware=hw)
    assert long.time.idle_s[IDLE_REDUCER] == 0  # 32k tokens: backward outlasts it
    # control: the reducer given every core no longer holds backward up
    monkeypatch.setattr(hwork, "REDUCER_SHARE", 1)
    assert plan(M14, 4096, batch=1, hardware=hw).time.idle_s[IDLE_REDUCER] < short.time.idle_s[IDLE_REDUCER]


def test_the_serial_resident_work_is_on_the_step():
    hw = get_hardware("h200-pcie")
    # every layer streamed, no optimizer on the device: the resident parameters update on the host
    pl = plan(M14, 4096, batch=8, hardware=hw, residency=Residency())
    m, t = pl.point.model, pl.time
    resident = m.param_count() - m.num_layers * m.layer_params()
    # FP32 read, bf16 written, at the rounding's measured distance from that bound
    assert t.idle_s[IDLE_ROUND] == pytest.approx(resident * (4 + 2) / hw.host_bw_bps
                                                 * HOST_RATES["resident rounding"].x_bound)
    per_param = t.optimizer_busy_s / m.param_count()
    assert t.idle_s[IDLE_RESIDENT] == pytest.approx(resident * per_param, rel=1e-9)
    # by the thread that runs each: the update on the launch thread, the rounding on its worker (the device waits
    # for both; test_resident_rounding_timeline.py)
    host = pl.timeline.host_busy_s
    assert host["launch thread (resident update)"] + host["resident rounding (its worker)"] == pytest.approx(
        t.idle_s[IDLE_ROUND] + t.idle_s[IDLE_RESIDENT])
    # FP32 compute uploads the masters themselves: nothing to round
    assert plan(M14, 4096, batch=8, hardware=hw, dtype="float32", residency=Residency()).time.idle_s[IDLE_ROUND] == 0
    # "auto" puts some layers' optimizer on the device, the resident parameters' with it (resident.py place_globals):
    # neither their update nor their rounding is the host's any more
    auto = plan(M14, 4096, batch=8, hardware=hw)
    assert auto.time.residency.optimizer > 0
    assert auto.time.idle_s[IDLE_ROUND] == auto.time.idle_s[IDLE_RESIDENT] == 0


@pytest.mark.parametrize("gpus,nodes", [(8, 1), (8, 2)])
def test_a_data_parallel_ranks_idle_causes_add_up_too(gpus, nodes):
    from megatrain.planner.multi import plan_point_multi
    from megatrain.planner.point import make_point
    from megatrain.planner.step_time import IDLE_COMM

    mp = plan_point_multi(make_point(M14, 4096, 8), get_hardware("h200-pcie"), gpus, nodes)
    tl = mp.rank.timeline
    assert sum(tl.idle_s.values()) == pytest.approx(tl.step_s - tl.gpu_busy_s, rel=1e-9)
    assert tl.idle_s[IDLE_COMM] == pytest.approx(mp.comm.added_s)


@pytest.mark.parametrize("cores", [8, 112])
def test_the_reducer_is_priced_at_the_one_pass_kernels_measured_rate_on_all_its_threads(monkeypatch, cores):
    from megatrain.engine.host import reduce_kernel

    hw = get_hardware("h200-pcie")
    monkeypatch.setitem(hwork.HOST_CORES, "h200-pcie", cores)
    threads = hwork.reducer_threads(hw)
    assert threads == side_threads(cores) and reduce_kernel.pays(threads)  # the engine takes the pass there too
    pl = plan(M14, 4096, batch=1, hardware=hw)
    r = pl.timeline.reducer
    # its lane's share of the host's bandwidth beside the globals' worker (host_work.lane_share_bps)
    share = hwork.lane_share_bps(hw, threads, hwork.globals_threads(hw))
    bound = pl.point.model.layer_params() * 10 / share
    # measured at 0.8x on one core: on more threads held at the bound (host_work.bounded_bps)
    assert HOST_RATES["reducer, one pass"].x_bound == pytest.approx(0.8) and threads > 1
    assert r.per_layer_s == pytest.approx(bound * max(HOST_RATES["reducer, one pass"].x_bound, 1.0))
    # control: bf16 gradient slabs are not the kernel's (reduce_kernel.usable): torch's two passes, 1.75x
    bf16 = plan(M14, 4096, batch=1, hardware=hw, master="hilo", host_grad_dtype="bfloat16").timeline.reducer
    two = pl.point.model.layer_params() * bf16.bytes_per_param / share
    assert bf16.per_layer_s == pytest.approx(two * HOST_RATES["reducer"].x_bound)
