"""The planner's data parallel (planner/multi.py): one host store per node, shared links, the reduction."""

from __future__ import annotations

import json

import pytest
from plan_cli import main  # --details: the tables these tests read

from megatrain.costs.modes import HostMaster, rollback_bytes_per_param
from megatrain.costs.rollback import layers_that_fit, rollback_budget
from megatrain.models.presets import get_preset
from megatrain.planner import get_hardware, plan, preflight
from megatrain.planner import multi as multi_mod
from megatrain.planner import plan_multi as _plan_multi
from megatrain.planner.memory import long_context_plan
from megatrain.planner.point import make_point
from megatrain.planner.step_time import megatrain_time

GIB = 1024**3
H200 = "h200-pcie"
MODEL = "llama2-7b"
# Residency "stream": every layer's optimizer state on the host on one GPU too, as data-parallel ranks keep it (a
# single GPU's "auto" would keep its layers' optimizer on the device, engine/update/resident.py), so one GPU and a
# node's ranks hold the same layer state.
POINT = dict(context=4096, batch=4, dtype="bfloat16", hardware=H200, residency="stream")
# These tests pin today's per-rank path (each rank streams every layer over its own link), which the engine runs;
# the node path the profile's NVLink allows is tests/unit/test_planner_node_path.py's.
PER_RANK = ["--data-path", "per-rank"]


def plan_multi(*args, **kw):
    return _plan_multi(*args, data_path="per-rank", **kw)


def _expected_node_bytes(n: int, m: int) -> int:
    """Host bytes of one node, from the preset's parameter counts and the profile's numbers alone: the
    layers' state once (fp32 master 4 + fp32 grad 4 + Adam 8 + bf16 shadow 2 B/param), the profile's
    reserve once, and everything else of the one-GPU plan once per rank, plus per rank a further
    process's runtime and, in a job of more than one rank, an FP32 transit buffer of two layers; then the
    speculative step's rollback copies once per node, of as many layers as fit what that leaves
    (costs/rollback.py's rule; one GPU: its own plan's)."""
    mdl, hw = get_preset(MODEL), get_hardware(H200)
    L, PL = mdl.num_layers, mdl.layer_params()
    one = plan(MODEL, **POINT, speculative_step=None if n * m == 1 else False).memory.host_total
    if n * m == 1:
        return one
    layer_state = L * PL * (4 + 4 + 8 + 2)
    reserve = int(hw.host_reserved_gib * GIB)
    transit = 2 * PL * 4
    per_rank = one - layer_state - reserve + int(hw.rank_runtime_gib * GIB) + transit
    # the one-GPU plan's own rank part holds at least the resident parameters' FP32 state (16 B/param)
    assert per_rank >= 16 * (mdl.param_count() - L * PL)
    held = one + transit + (n - 1) * per_rank
    per_param = rollback_bytes_per_param(HostMaster.FP32, True)
    count = layers_that_fit(mdl.layer_sizes(), per_param, rollback_budget(hw.host_bytes - held))
    assert count > 0
    return held + per_param * sum(mdl.layer_sizes()[:count])


def _check_node_bytes(fn=plan_multi) -> None:
    for n in (1, 2, 4, 8):
        for m in (1, 2):
            got = fn(MODEL, gpus_per_node=n, nodes=m, **POINT).host_node_bytes
            assert got == _expected_node_bytes(n, m), (n, m)


def test_node_host_bytes_are_one_gpu_plus_per_rank_terms():
    _check_node_bytes()
    assert plan_multi(MODEL, **POINT).host_node_bytes == plan(MODEL, **POINT).memory.host_total


def test_layer_state_does_not_scale_with_gpus():
    mdl = get_preset(MODEL)
    held_once = {n: sum(plan_multi(MODEL, gpus_per_node=n, **POINT).layer_state.values()) for n in (1, 2, 8)}
    reserve = int(get_hardware(H200).host_reserved_gib * GIB)
    assert set(held_once.values()) == {mdl.num_layers * mdl.layer_params() * 18 + reserve}
    # so 8 GPUs hold far less than 8 private copies would
    one = plan(MODEL, **POINT).memory.host_total
    assert plan_multi(MODEL, gpus_per_node=8, **POINT).host_node_bytes < 0.5 * 8 * one


def test_negative_control_host_bytes_multiplied_by_gpus_are_caught(monkeypatch):
    real = multi_mod.node_memory

    def private_copies(pl, n, nodes=1, *rest):  # what a store per rank would hold: everything x N
        mem, layer, rank = real(pl, n, nodes, *rest)
        mem.host = {k: v * n for k, v in pl.memory.host.items()}
        return mem, layer, rank

    monkeypatch.setattr(multi_mod, "node_memory", private_copies)
    with pytest.raises(AssertionError):
        _check_node_bytes()


def test_inter_node_allreduce_scales_as_2_m_minus_1_over_m():
    mdl, hw = get_preset(MODEL), get_hardware(H200)
    L, PL, P = mdl.num_layers, mdl.layer_params(), mdl.param_count()
    comms = {m: plan_multi(MODEL, gpus_per_node=8, nodes=m, **POINT).comm for m in (1, 2, 4, 8)}
    assert comms[1].network_bytes == 0 and comms[1].network_layers_s == 0 and comms[1].network_exposed_s == 0
    for m in (2, 4, 8):
        ring = 2 * (m - 1) / m
        assert comms[m].network_bytes == int(ring * 4 * P)
        assert comms[m].network_layers_s == pytest.approx(ring * 4 * L * PL / (hw.network_gbs * 1e9), rel=1e-12)
        assert comms[m].network_globals_s == pytest.approx(ring * 4 * (P - L * PL) / (hw.network_gbs * 1e9))
        # never less than the last layer on its owner's NIC, never more than the whole all-reduce
        assert 8 * comms[m].network_layers_s / L <= comms[m].network_exposed_s + 1e-15
        assert comms[m].network_exposed_s <= comms[m].network_layers_s
    assert comms[4].network_layers_s / comms[2].network_layers_s == pytest.approx(1.5)
    # a slow network cannot hide under backward: all of it but what backward covers shows
    slow = plan_multi(MODEL, gpus_per_node=8, nodes=2, network_gbs=1.0, **POINT)
    bwd = slow.rank.time.backward_s
    assert slow.comm.network_exposed_s == pytest.approx(slow.comm.network_layers_s - bwd * (L - 1) / L)


def test_one_gpu_one_node_is_todays_plan(capsys):
    args = ["--model", "7b", "--context", "4096", "--batch", "4", "--hardware", H200, "--no-search"]
    assert main(args) == 0
    today = capsys.readouterr().out
    assert main([*args, "--gpus-per-node", "1", "--nodes", "1"]) == 0
    assert capsys.readouterr().out == today and "data parallel" not in today
    mp, pl = plan_multi(MODEL, **POINT), plan(MODEL, **POINT)
    assert mp.rank.time == pl.time and mp.rank.memory.host == pl.memory.host and mp.scaling_efficiency == 1.0
    # owning every layer is the optimizer as one process runs it
    p, hw = pl.point, pl.hardware
    off = long_context_plan(p, hw).offload
    assert megatrain_time(p, hw, off, owned_layers=p.model.num_layers) == megatrain_time(p, hw, off)


@pytest.mark.parametrize("extra,needles", [
    (["--gpus-per-node", "0"], ["--gpus-per-node 0", ">= 1"]),
    (["--gpus-per-node", "-2"], ["--gpus-per-node -2", ">= 1"]),
    (["--gpus-per-node", "16"], ["--gpus-per-node 16", "has 8 GPU(s) per node", "at most 8", "--hardware-file"]),
    (["--nodes", "0"], ["--nodes 0", ">= 1"]),
    (["--nodes", "2", "--hardware", "rtx4090"], ["--nodes 2", "'rtx4090'", "network_gbs", "--network-gbs"]),
    (["--nodes", "2", "--network-gbs", "-5"], ["--network-gbs -5", "> 0"]),
    (["--gpus-per-node", "2", "--backend", "torch"], ["megatrain's data parallel and ZeRO-3", "'torch'"]),
    (["--gpus-per-node", "2", "--data-path", "node", "--hardware", "h100-pcie"],
     ["--data-path node", "'h100-pcie' has no NVLink", "per-rank path"]),
    (["--gpus-per-node", "2", "--gpus-per-host-link", "0"], ["--gpus-per-host-link 0", ">= 1"]),
])
def test_bad_topologies_are_refused_naming_value_and_fix(capsys, extra, needles):
    assert main(["--model", "7b", "--hardware", H200, "--no-search", *extra]) == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, (needle, err)


def test_cli_multi_prints_node_figures_and_json(capsys):
    args = ["--model", "7b", "--context", "4096", "--batch", "4", "--hardware", H200, "--no-search",
            "--gpus-per-node", "8", "--nodes", "2", "--master", "fp32", *PER_RANK]
    assert main(args) == 0
    out = capsys.readouterr().out
    for needle in ("host (per node, 8 GPUs)", "data parallel: 8 GPU(s) per node x 2 node(s) = 16 ranks",
                   "ring all-reduce", "scaling efficiency", "1 of 8 GPUs per node"):
        assert needle in out, needle
    assert main([*args, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["data_parallel"]
    assert d["world_size"] == 16 and d["host_node_bytes"] == _expected_node_bytes(8, 2)
    assert d["job_tokens_per_s"] == pytest.approx(16 * 4 * 4096 / d["rank_step_s"])
    assert d["scaling_efficiency"] == pytest.approx(d["job_tokens_per_s"] / (16 * d["single_gpu_tokens_per_s"]))


def test_shared_host_slows_each_gpu_and_efficiency_stays_below_one():
    one = plan_multi(MODEL, **POINT)
    prev = one.step_s
    for n in (2, 4, 8):
        mp = plan_multi(MODEL, gpus_per_node=n, **POINT)
        assert mp.rank.hardware.host_memory_bw_gbs_achieved == pytest.approx(300 / n)
        assert mp.step_s >= prev - 1e-12 and 0 < mp.scaling_efficiency <= 1
        assert mp.rank.memory.device == one.rank.memory.device  # device bytes per GPU do not change
        prev = mp.step_s
    # two GPUs behind one host link each get half of it when host DRAM is not what binds
    pair = plan_multi(MODEL, gpus_per_node=2, gpus_per_host_link=2, host_memory_gib=1536, **{
        k: v for k, v in POINT.items() if k != "hardware"}, hardware=get_hardware(H200).with_(
            host_memory_bw_gbs_achieved=10_000.0))
    assert pair.rank.hardware.link_gbs_achieved == pytest.approx(55 / 2)


def test_fit_verdict_is_per_node():
    # 7B fits a 1.5 TB node with one GPU; shrink the host to just above that and 8 GPUs no longer fit (no speculative
    # step on either side: its "auto" takes only the room left, so it would never make a point not fit)
    point = {**POINT, "speculative_step": False}
    one = plan_multi(MODEL, **point)
    tight = (one.host_node_bytes + 2**30) / GIB
    assert plan_multi(MODEL, host_memory_gib=tight, **point).fits
    eight = plan_multi(MODEL, gpus_per_node=8, host_memory_gib=tight, **point)
    assert not eight.fits and any("host (per node, 8 GPUs)" in r and "DOES NOT FIT" in r for r in eight.rank.reasons)


def test_preflight_charges_the_node():
    alone = preflight("tiny", 128, dtype="float32", host_available=2**34)
    two = preflight("tiny", 128, dtype="float32", host_available=2**34, gpus_per_node=2)
    assert two.host_needed > alone.host_needed and "2 ranks sharing this host" in two.reason
    with pytest.raises(ValueError, match="gpus_per_node=0"):
        preflight("tiny", 128, dtype="float32", host_available=2**34, gpus_per_node=0)


def test_node_fields_are_validated():
    raw = {k: v for k, v in get_hardware(H200).sources.items()}
    assert raw["gpus_per_node"].startswith("assumption")
    from megatrain.planner.hardware import load_raw

    entry = load_raw()["profiles"][H200]
    with pytest.raises(ValueError, match="exceeds gpus_per_node"):
        get_hardware({**entry, "name": "x", "gpus_per_host_link": {"value": 9, "source": "assumption"}})
    with pytest.raises(ValueError, match="whole number"):
        get_hardware({**entry, "name": "x", "gpus_per_node": {"value": 2.5, "source": "assumption"}})
    assert get_hardware("rtx4090").gpus_per_node == 1 and get_hardware("rtx4090").network_gbs is None


def test_every_host_mode_counts_the_layers_once_per_node():
    """hilo + optimizer in backward shares the node's store as the FP32 modes do (data_parallel_host 'auto'):
    a second rank adds its own terms (a small part of a layer-heavy model), never a second copy of the layers'
    12 B/param; its transit holds the two averaged layers its in-backward updates read on top of the staging."""
    mdl = get_preset(MODEL)
    LP = mdl.num_layers * mdl.layer_params()
    modes = dict(master="hilo", optimizer_in_backward=True, grad_clip=False)
    one, two = (plan_multi(MODEL, gpus_per_node=n, **POINT, **modes).host_node_bytes for n in (1, 2))
    assert two - one < LP * 12 / 3  # a replicated store would add LP x 12 B (hi + lo + Adam m, v)
    # (no speculative step: its "auto" copies as many layers as fit the room each node leaves, more on one GPU's)
    fp32_one, fp32_two = (plan_multi(MODEL, gpus_per_node=n, **POINT, speculative_step=False).host_node_bytes
                          for n in (1, 2))
    point = {k: v for k, v in POINT.items() if k != "hardware"}
    transit, fp32_transit = (multi_mod.transit_bytes(make_point(MODEL, **point, **m)) for m in (modes, {}))
    assert transit == 2 * fp32_transit
    # What the second rank adds beyond the FP32 modes' second rank: its doubled transit, one per rank, and its
    # FP32 scratch (master and gradient of one layer: 8 B per layer parameter), nothing per layer of the model.
    scratch = 8 * mdl.layer_params()
    assert (two - one) - (fp32_two - fp32_one) == 2 * (transit - fp32_transit) + scratch
