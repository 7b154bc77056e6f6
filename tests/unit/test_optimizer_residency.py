"""Optimizer residency (residency {"optimizer": k}, engine/update/resident.py): the first k layers' FP32 master,
gradient slab and Adam state live and update on the device, and train bit for bit as the host path does.

On a CPU device the device is the host, so every comparison is exact (torch.equal): losses, pre-clip norms, every
weight and every Adam moment, over steps that clip, accumulate two micro-batches, follow an LR schedule and resume
from a checkpoint, in FP32 and in the GPU's defaults (bf16 compute, the exact hi/lo master, the update overlapped).
What moves is counted too: an optimizer-resident layer's gradient is never copied down and its weights never
copied up. The controls: a clip norm that leaves the device layers out, and a device update that skips the clip,
must both be caught.
"""

from __future__ import annotations

import contextlib
import io
import itertools

import pytest
import torch
from conftest import make_batches, tiny_model
from gpu_defaults import CONFIGS, FP32
from kit import adam_state, adamw_engine, train_steps

from megatrain.config.schema import EngineConfig
from megatrain.costs.modes import HostMaster
from megatrain.costs.residency import OPTIMIZER_BYTES_PER_PARAM, Residency, parse, plan, plan_optimizer
from megatrain.engine import Engine
from megatrain.engine import engine as engine_module

LAYERS, MICRO = 4, 2
CLIP = 0.05  # below every step's norm here: each step clips (asserted)


# -- the setting -------------------------------------------------------------------------------------------
def test_the_setting_parses_describes_and_refuses_bad_counts():
    r = parse({"weights": 3, "activations": 1, "optimizer": 2})
    assert r == Residency(3, 1, 2) and r.updated_on_device == frozenset({0, 1})
    assert r.to_dict() == {"weights": 3, "activations": 1, "optimizer": 2}
    assert "2 update on the device" in r.describe(4)
    assert parse({"weights": 2}).optimizer == 0
    assert Residency(3, 1, 2).capped(1) == Residency(1, 1, 1)
    with pytest.raises(ValueError, match=r"optimizer=3 > weights=2.*set weights >= 3"):
        Residency(2, 0, 3)
    with pytest.raises(ValueError, match=r"optimizer=-1 must be an int >= 0"):
        Residency(2, 0, -1)
    with pytest.raises(ValueError, match=r"'optimizer': k"):
        parse({"weights": 2, "optimiser": 1})


def test_plans_keep_the_optimizer_layers_and_size_the_auto_count():
    # Kept whatever the room: their weights are their device master's shadow.
    assert plan(4, 100, 50, 0, 0, True, optimizer=2) == Residency(2, 0, 2)
    assert plan(4, 100, 50, 250, 0, False, optimizer=1) == Residency(2, 0, 1)
    assert plan(4, 100, 50, None, 0, True, weights_cap=1, optimizer=3) == Residency(3, 3, 3)
    # each layer: its compute-dtype weights and 16 B/param
    per = 10 * (2 + OPTIMIZER_BYTES_PER_PARAM)
    assert [plan_optimizer(4, 10, 2, room) for room in (per - 1, per, 3 * per + 5, 10 * per, None)] == [0, 1, 3, 4, 4]


def test_refused_with_the_reason_where_it_cannot_run():
    with pytest.raises(ValueError, match=r"optimizer=1: optimizer_in_backward.*set residency 'optimizer' to 0"):
        Engine(tiny_model("llama", layers=2),
               EngineConfig(residency={"weights": 1, "optimizer": 1}, optimizer_in_backward=True, parity_probe=False))
    with pytest.raises(ValueError, match=r"host_master='bf16' is not exact"):
        Engine(tiny_model("llama", layers=2), EngineConfig(residency={"weights": 1, "optimizer": 1}, parity_probe=False,
                                                            compute_dtype="bfloat16", host_master="bf16"))


# -- training --------------------------------------------------------------------------------------------
def _engine(seed: int, k: int, mode: dict, **cfg) -> tuple[Engine, torch.optim.lr_scheduler.LRScheduler]:
    # (the parity probe checks the model, not the update: off, for time)
    return adamw_engine(tiny_model("llama", layers=LAYERS, seed=seed),
                        EngineConfig(residency={"weights": LAYERS, "activations": 0, "optimizer": k},
                                     parity_probe=False, **mode, **cfg))


def _steps(eng: Engine, sched, batches: list, steps: int) -> tuple[list[float], list[float]]:
    """`steps` steps, each accumulating every batch of `batches` (the same ones each step), clipped to CLIP."""
    return train_steps(eng, itertools.cycle(batches), steps, accum=len(batches), clip=CLIP, scheduler=sched)


def _adam(eng: Engine) -> list[torch.Tensor]:
    return adam_state(eng)


def _run(k: int, mode: dict, **cfg) -> tuple:
    """Two steps, a checkpoint (weights, Adam state, schedule) through torch.save, a fresh engine resumed from it,
    two more steps: losses, pre-clip norms, final weights and Adam state."""
    batches = make_batches(MICRO)
    eng, sched = _engine(0, k, mode, **cfg)
    assert eng.pipeline.residency_stats()["optimizer_resident_layers"] == k
    first = _steps(eng, sched, batches, 2)
    buf = io.BytesIO()
    torch.save({"weights": eng.state_dict(), "optim": eng.optimizer.state_dict(), "sched": sched.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf)
    resumed, sched2 = _engine(7, k, mode, **cfg)
    resumed.load_state_dict(ckpt["weights"])
    resumed.optimizer.load_state_dict(ckpt["optim"])
    sched2.load_state_dict(ckpt["sched"])
    second = _steps(resumed, sched2, batches, 2)
    return first[0] + second[0], first[1] + second[1], list(resumed.state_dict().values()), _adam(resumed), resumed


def _same(a: tuple, b: tuple) -> None:
    assert a[0] == b[0], "losses"
    assert a[1] == b[1], "pre-clip norms"
    assert len(a[2]) == len(b[2]) and all(torch.equal(x, y) for x, y in zip(a[2], b[2])), "weights"
    assert len(a[3]) == len(b[3]) and all(torch.equal(x, y) for x, y in zip(a[3], b[3])), "Adam state"


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, LAYERS])
@pytest.mark.parametrize("mode", CONFIGS)
def test_device_layers_train_bit_for_bit_as_host_layers(mode, k):
    ref = _run(0, mode)
    assert all(n > CLIP for n in ref[1])  # every step clipped: the clip reaches the device layers' gradients
    run = _run(k, mode)
    _same(run, ref)
    eng = run[4]
    # An exact hi/lo master became an FP32 master for the device layers; the others keep the host's mode.
    modes = [g.master_mode for g in eng.store.layers]
    assert modes[:k] == [HostMaster.FP32] * k
    assert modes[k:] == [eng.store.master_mode] * (LAYERS - k)


def test_speculative_step_leaves_the_device_layers_to_the_step():
    mode = {"compute_dtype": "bfloat16", "host_master": "hilo", "link_gbps": 0.05}
    _same(_run(2, {**mode, "speculative_step": True}), _run(0, {**mode, "speculative_step": False}))


def test_no_gradient_copied_down_and_no_weights_copied_up_for_device_layers():
    """With an emulated link (kept layers copied as on a GPU), each device layer removes exactly its gradient's
    copies down and its weights' copies up; the trace shows no gradient job for it."""
    batches = make_batches(MICRO)
    stats, traces = {}, {}
    for k in (0, 2, LAYERS):
        eng, sched = _engine(0, k, FP32, link_gbps=100.0, trace=True)
        eng.reset_stats()
        _steps(eng, sched, batches, 3)
        stats[k] = eng.collect_stats()
        traces[k] = eng.trace
    layer_bytes = eng.store.layers[0].numel * 4
    assert all(g.numel * 4 == layer_bytes for g in eng.store.layers)
    grads_per_layer = layer_bytes * MICRO * 3  # every micro-batch's gradient
    for k in (2, LAYERS):
        assert stats[0]["d2h_bytes"] - stats[k]["d2h_bytes"] == k * grads_per_layer
        assert {r.layer for r in traces[k] if r.stream == "d2h" and r.kind == "grad"} == set(range(k, LAYERS))
    ups = stats[0]["h2d_bytes"] - stats[2]["h2d_bytes"]
    assert ups > 0 and stats[2]["h2d_bytes"] - stats[LAYERS]["h2d_bytes"] == ups  # linear in the device layers
    assert ups % layer_bytes == 0


# -- the controls ------------------------------------------------------------------------------------------
def test_negative_control_a_norm_without_the_device_layers_is_caught(monkeypatch):
    """Leaving the device layers' gradients out of the clip norm changes the training: the test above can fail."""
    ref = _run(0, FP32)
    real = engine_module.slab_norm
    device_slabs: set[int] = set()

    def norm_without_device_layers(g: torch.Tensor) -> torch.Tensor:
        return torch.zeros((), dtype=torch.float32) if g.data_ptr() in device_slabs else real(g)

    real_init = Engine.__init__

    def init(self, *a, **kw):
        real_init(self, *a, **kw)
        device_slabs.update(self.store.layers[i].grad.data_ptr() for i in self.optimizer_layers)

    monkeypatch.setattr(Engine, "__init__", init)
    monkeypatch.setattr(engine_module, "slab_norm", norm_without_device_layers)
    monkeypatch.setattr(engine_module, "landed_norms", lambda store, slabs, pending: [None] * (len(store.layers) + 1))
    broken = _run(2, FP32)
    with pytest.raises(AssertionError, match="losses|pre-clip norms"):
        _same(broken, ref)


def test_negative_control_a_device_update_that_skips_the_clip_is_caught(monkeypatch):
    """A device layer updated from its unclipped gradients trains differently (the bf16 slab path: the clip is
    pending on the layers' slabs until their update)."""
    mode = {"compute_dtype": "bfloat16", "host_master": "hilo", "optimizer_overlap": True}
    ref = _run(0, mode)
    from megatrain.engine.update import update as update_module
    real = update_module.update_layer

    def unclipped(layered, group, i, coefs, threads=None):
        on_device = group.master_mode is HostMaster.FP32 and i < 2
        real(layered, group, i, [] if on_device else coefs, threads)

    monkeypatch.setattr(update_module, "update_layer", unclipped)
    with pytest.raises(AssertionError):
        _same(_run(2, mode), ref)


# -- "auto" ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg, expect", [
    ({"compute_dtype": "float32"}, LAYERS),  # the host is the device: an FP32 master is there already
    ({"compute_dtype": "bfloat16", "host_master": "hilo"}, 0),  # would take the FP32 bytes hilo saves
    ({"compute_dtype": "float32", "link_gbps": 100.0}, 0),  # an emulated GPU of unknown size
    ({"compute_dtype": "float32", "optimizer_overlap": True}, 0),  # the host's update asked for
    ({"compute_dtype": "float32", "device_budget_bytes": 2**40}, LAYERS),  # the whole state fits
    ({"compute_dtype": "float32", "device_budget_bytes": 2**20}, 0),  # not even the kept weights fit
])
def test_auto_counts(cfg, expect):
    eng = Engine(tiny_model("llama", layers=LAYERS), EngineConfig(parity_probe=False, **cfg))
    assert len(eng.optimizer_layers) == expect
    assert eng.pipeline.residency_stats()["optimizer_resident_layers"] == expect


def test_auto_under_a_budget_keeps_what_fits_after_every_layers_weights():
    """An emulated budget that holds every layer's weights and two layers' optimizer state (beside the fixed bytes
    and a 4096-token batch's working set) keeps exactly two."""
    probe = Engine(tiny_model("llama", layers=LAYERS), EngineConfig(parity_probe=False, compute_dtype="float32",
                                                                   device_budget_bytes=2**40)).pipeline.policy
    per_layer = probe.dims.numel * OPTIMIZER_BYTES_PER_PARAM
    # the room the budget leaves beyond the state of `k` layers, solved for the budget
    base = probe.fixed_bytes - LAYERS * per_layer  # without the optimizer state it took
    reserve = probe._plan(4096).predicted_peak_bytes - probe.fixed_bytes
    for k in (1, 2):
        need = base + reserve + probe._weights_bytes(LAYERS) + k * per_layer + per_layer // 2
        budget = int(need / 0.9) + 1
        got = Engine(tiny_model("llama", layers=LAYERS), EngineConfig(parity_probe=False, compute_dtype="float32",
                                                                     device_budget_bytes=budget))
        assert len(got.optimizer_layers) == k


def test_the_start_line_says_what_auto_chose():
    from megatrain.run.start_line import describe

    eng = Engine(tiny_model("llama", layers=LAYERS), EngineConfig(parity_probe=False, compute_dtype="float32"))
    assert f"{LAYERS} layers' optimizer on the device" in describe("engine", eng, eng.optimizer)
    host = Engine(tiny_model("llama", layers=LAYERS), EngineConfig(parity_probe=False, compute_dtype="float32",
                                                                  optimizer_overlap=True))
    assert "optimizer on the device" not in describe("engine", host, host.optimizer)


@pytest.mark.parametrize("mode", CONFIGS)
def test_a_non_finite_device_gradient_skips_the_step_as_a_host_one_does(mode):
    """A NaN in layer 0's gradient (on the device for k=2, on the host for k=0) skips that step on both, and the
    training after it is the same bits."""
    def run(k: int) -> tuple:
        eng, sched = _engine(0, k, mode)
        batches, losses, skipped = make_batches(1), [], []
        for step in range(3):
            out = eng(**batches[0])
            eng.backward(out.loss)
            losses.append(out.loss.item())
            if step == 1:
                eng.synchronize()
                eng.store.layers[0].grad[0] = float("nan")
            with pytest.warns(UserWarning, match="non-finite") if step == 1 else contextlib.nullcontext():
                skipped.append(not eng.step())
            eng.zero_grad()
        return losses, skipped, [t.clone() for t in eng.state_dict().values()], _adam(eng)

    ref, dev = run(0), run(2)
    assert ref[1] == dev[1] == [False, True, False]
    assert ref[0] == dev[0] and all(torch.equal(a, b) for a, b in zip(ref[2], dev[2]))
    assert all(torch.equal(a, b) for a, b in zip(ref[3], dev[3]))


# -- the planner -------------------------------------------------------------------------------------------
def test_the_planner_moves_the_update_copies_and_state_of_device_layers():
    """llama2-7b on an H200, every layer's weights kept: 16 of 32 layers updating on the device take their
    gradients' copies down off the link, their AdamW off the host (onto the device, at its bandwidth) and their
    FP32 state from host to device memory, exactly by their share; the resident parameters (embedding, head, norm)
    go with them (resident.py place_globals): their gradient copies down and upload too."""
    from megatrain.planner import plan
    from megatrain.planner.hardware import GB, get_hardware
    from megatrain.planner.step_time import device_optimizer_bytes_per_param, globals_io

    hw = get_hardware("h200-pcie")
    host, half = (plan("llama2-7b", 4096, 1, hardware="h200-pcie", residency=Residency(32, 0, k)) for k in (0, 16))
    PL = host.point.model.layer_params()
    G = host.point.model.param_count() - 32 * PL
    io = globals_io(host.point, hw)
    assert io.down_bytes > 0 and io.up_bytes > 0
    assert host.time.busy_s["device optimizer"] == 0.0
    assert half.time.busy_s["device optimizer"] == pytest.approx(
        (16 * PL + G) * device_optimizer_bytes_per_param(half.point) / (hw.device_memory_bw_gbs * GB))
    assert half.time.busy_s["host optimizer"] < host.time.busy_s["host optimizer"] * 0.55
    layer_grads = 32 * PL * 2  # bf16 gradients of every layer, one micro-batch
    assert host.time.d2h_bytes - half.time.d2h_bytes == layer_grads // 2 + io.down_bytes
    assert host.time.h2d_bytes - half.time.h2d_bytes == 16 * PL * 2 + io.up_bytes  # each kept layer's refresh
    assert host.memory.host["adam m"] - half.memory.host["adam m"] == (16 * PL + G) * 4
    assert half.memory.device["optimizer-resident layers' FP32 master, gradients, Adam m and v"] == 16 * PL * 16
    assert half.memory.device["resident parameters' FP32 master, gradients, Adam m and v"] == G * 16
    assert host.memory.device["resident parameters' FP32 master, gradients, Adam m and v"] == 0
    assert half.time.step_s < host.time.step_s


def test_the_planners_engine_fill_reserves_one_sequence_whatever_the_micro_batch():
    """The engine sizes "auto"'s optimizer state at build, leaving one sequence of the model's context window free
    (resident.reserve_tokens): the planner's replay of that fill gives the same count at every micro-batch."""
    from megatrain.planner import plan

    # the host mode pinned: "auto" picks hilo + bf16 slabs at batch 8 (18 B/param of optimizer state, fewer layers)
    counts = {b: plan("llama2-7b", 4096, b, hardware="gh200", host_master="fp32",
                      host_grad_dtype="float32").placement.engine.optimizer for b in (1, 4, 8)}
    assert counts[1] == counts[4] == counts[8] > 0, counts
