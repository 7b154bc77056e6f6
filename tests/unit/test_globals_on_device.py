"""The resident parameters' optimizer on the device (engine/update/resident.py place_globals): whenever any layer's
optimizer is there, the embedding's, final norm's and LM head's FP32 master, gradient slab and Adam state go too.

On a CPU device the device is the host, so the globals' update there is the host path's own (the same function,
the same bits): every comparison is exact, tied and untied embeddings, in FP32 and the GPU's defaults (bf16
compute, the hi/lo master, the update overlapped), over steps that clip, accumulate, follow an LR schedule and
resume from a checkpoint. What changes with the setting is checked too: no staged upload, no gradient worker,
their state in the device budget. The control: a clip norm that leaves the globals out is caught.
"""

from __future__ import annotations

import io
import itertools

import pytest
import torch
from conftest import make_batches, tiny_model
from gpu_defaults import CONFIGS, FP32
from kit import adam_state, adamw_engine, train_steps

from megatrain.config.schema import EngineConfig
from megatrain.costs.residency import OPTIMIZER_BYTES_PER_PARAM
from megatrain.engine import Engine
from megatrain.engine import engine as engine_module

LAYERS, MICRO = 3, 2
CLIP = 0.05  # below every step's norm here: each step clips (asserted)


def _engine(seed: int, k: int, mode: dict, tied: bool, **cfg) -> tuple[Engine, object]:
    return adamw_engine(tiny_model("llama", layers=LAYERS, seed=seed, tied=tied),
                        EngineConfig(residency={"weights": LAYERS, "activations": 0, "optimizer": k},
                                     parity_probe=False, **mode, **cfg))


def _steps(eng: Engine, sched, batches: list, steps: int) -> tuple[list[float], list[float]]:
    """`steps` steps, each accumulating every batch of `batches` (the same ones each step), clipped to CLIP."""
    return train_steps(eng, itertools.cycle(batches), steps, accum=len(batches), clip=CLIP, scheduler=sched)


def _globals_adam(eng: Engine) -> list[torch.Tensor]:
    return adam_state(eng, eng.store.globals.params)


def _run(k: int, mode: dict, tied: bool) -> tuple:
    """Two steps, a checkpoint through torch.save, a fresh engine resumed from it, one more step."""
    batches = make_batches(MICRO)
    eng, sched = _engine(0, k, mode, tied)
    first = _steps(eng, sched, batches, 2)
    buf = io.BytesIO()
    torch.save({"weights": eng.state_dict(), "optim": eng.optimizer.state_dict(), "sched": sched.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf)
    resumed, sched2 = _engine(7, k, mode, tied)
    resumed.load_state_dict(ckpt["weights"])
    resumed.optimizer.load_state_dict(ckpt["optim"])
    sched2.load_state_dict(ckpt["sched"])
    second = _steps(resumed, sched2, batches, 1)
    return (first[0] + second[0], first[1] + second[1], list(resumed.state_dict().values()), _globals_adam(resumed),
            resumed)


def _same(a: tuple, b: tuple) -> None:
    assert a[0] == b[0], "losses"
    assert a[1] == b[1], "pre-clip norms"
    assert len(a[2]) == len(b[2]) and all(torch.equal(x, y) for x, y in zip(a[2], b[2])), "weights"
    assert len(a[3]) == len(b[3]) > 0 and all(torch.equal(x, y) for x, y in zip(a[3], b[3])), "globals' Adam state"


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("mode", CONFIGS)
def test_globals_on_the_device_train_bit_for_bit_as_on_the_host(mode, tied):
    ref = _run(0, mode, tied)
    assert not ref[4].globals_on_device
    assert all(n > CLIP for n in ref[1])  # every step clipped: the clip reaches the globals' gradients
    run = _run(1, mode, tied)
    assert run[4].globals_on_device
    _same(run, ref)
    n_globals = 2 if tied else 3  # embedding, norm (, head): a tied head is the embedding, one parameter
    assert len(run[4].store.globals.params) == n_globals and len(run[3]) == 3 * n_globals


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("mode", CONFIGS)
def test_globals_relocated_to_fresh_buffers_train_bit_for_bit(mode, tied, monkeypatch):
    """On a CPU device the globals' FP32 master is where it would go, so nothing moves; here it is moved anyway, to
    fresh buffers (master, gradient slab, Adam state made beside them), as a move to a GPU does: any part of the
    engine still holding the old buffers (the gradient sink, the optimizer's views, the norm, the clip, zero_grad,
    the compute copies' refresh, state_dict) would train differently or not at all."""
    from megatrain.engine.update import resident

    ref = _run(0, mode, tied)
    moved: list[int] = []

    def relocating(store, count, device):
        if not count:
            return False
        old = store.globals.master.data_ptr()
        resident.move(store.globals, device, relocate=True)
        moved.append(int(store.globals.master.data_ptr() != old))
        return True

    monkeypatch.setattr(resident, "place_globals", relocating)
    run = _run(1, mode, tied)
    assert moved == [1, 1]  # both engines' globals in fresh buffers
    _same(run, ref)


def test_the_globals_go_with_the_layers_and_leave_the_upload_and_the_gradient_worker():
    off, _ = _engine(0, 0, FP32, False)
    on, _ = _engine(0, 1, FP32, False)
    assert (off.globals_on_device, on.globals_on_device) == (False, True)
    assert on.placement.upload is None  # refreshed on the device, never staged and uploaded
    assert not on._global_grads.asynchronous and on._global_grads._staging is None  # added where they are made
    from megatrain.run.start_line import describe

    assert "embedding/norm/head" in describe("engine", on, on.optimizer)
    assert "embedding/norm/head" not in describe("engine", off, off.optimizer)


def test_refused_where_layers_are_refused_and_the_host_path_kept():
    """"auto" where resident.refusal() refuses (the optimizer in backward): no layer and no global on the device."""
    eng = Engine(tiny_model("llama", layers=2), EngineConfig(optimizer_in_backward=True, parity_probe=False,
                                                              compute_dtype="float32"))
    assert len(eng.optimizer_layers) == 0 and not eng.globals_on_device


def test_auto_under_a_budget_counts_the_globals_state_first():
    """The emulated budget that held two layers' state holds one once the globals' 16 B/param are taken first."""
    probe = Engine(tiny_model("llama", layers=LAYERS), EngineConfig(parity_probe=False, compute_dtype="float32",
                                                                   device_budget_bytes=2**40))
    policy = probe.pipeline.policy
    per_layer = policy.dims.numel * OPTIMIZER_BYTES_PER_PARAM
    glob = probe.store.globals.numel * OPTIMIZER_BYTES_PER_PARAM
    assert probe.globals_on_device and len(probe.optimizer_layers) == LAYERS
    base = policy.fixed_bytes - LAYERS * per_layer - glob  # without the optimizer state it took
    reserve = policy._plan(4096).predicted_peak_bytes - policy.fixed_bytes
    for k, with_globals in ((1, True), (2, True), (0, False)):
        need = base + reserve + policy._weights_bytes(LAYERS) + k * per_layer + per_layer // 2
        need += glob if with_globals else glob // 2
        got = Engine(tiny_model("llama", layers=LAYERS), EngineConfig(
            parity_probe=False, compute_dtype="float32", device_budget_bytes=int(need / 0.9) + 1))
        assert (len(got.optimizer_layers), got.globals_on_device) == (k, with_globals)


def test_negative_control_a_norm_without_the_globals_is_caught(monkeypatch):
    """Leaving the globals' gradients out of the clip norm changes the training: the bit test can fail."""
    ref = _run(0, FP32, False)
    real = engine_module.slab_norm

    def norm_without_globals(g: torch.Tensor) -> torch.Tensor:
        return torch.zeros((), dtype=torch.float32) if g.numel() == globals_numel else real(g)

    globals_numel = ref[4].store.globals.numel
    monkeypatch.setattr(engine_module, "slab_norm", norm_without_globals)
    with pytest.raises(AssertionError, match="losses|pre-clip norms"):
        _same(_run(1, FP32, False), ref)


# -- the planner -------------------------------------------------------------------------------------------
def test_the_planner_takes_the_globals_update_copies_and_state_off_the_host_with_any_device_layer():
    """llama2-7b on an H200 at 1 x 4096, every layer's weights kept: one optimizer-resident layer takes the resident
    parameters' update off the launch thread (and their rounding and upload off the step), their gradients off the
    link, their FP32 state from host to device memory, and puts their AdamW on the device at its bandwidth."""
    from megatrain.costs.residency import Residency as R
    from megatrain.planner import plan
    from megatrain.planner import step_time as st
    from megatrain.planner.hardware import GB, get_hardware
    from megatrain.planner.step_time import device_optimizer_bytes_per_param, globals_io

    IDLE_RESIDENT, IDLE_ROUND, IDLE_UPLOAD = st.IDLE_RESIDENT, st.IDLE_ROUND, st.IDLE_UPLOAD

    hw = get_hardware("h200-pcie")
    host, one = (plan("llama2-7b", 4096, 1, hardware="h200-pcie", residency=R(32, 0, k)) for k in (0, 1))
    m = host.point.model
    PL, G = m.layer_params(), m.param_count() - m.num_layers * m.layer_params()
    assert all(host.time.idle_s[c] > 0 for c in (IDLE_RESIDENT, IDLE_ROUND, IDLE_UPLOAD))
    assert all(one.time.idle_s[c] == 0 for c in (IDLE_RESIDENT, IDLE_ROUND, IDLE_UPLOAD))
    assert one.time.embed_io_s == 0 < host.time.embed_io_s
    io = globals_io(host.point, hw)
    assert host.time.d2h_bytes - one.time.d2h_bytes == PL * 2 + io.down_bytes
    assert one.time.busy_s["device optimizer"] == pytest.approx(
        (PL + G) * device_optimizer_bytes_per_param(one.point) / (hw.device_memory_bw_gbs * GB))
    assert one.memory.host["master weights"] == host.memory.host["master weights"] - PL * 4 - G * 4
    assert one.memory.device["resident parameters' FP32 master, gradients, Adam m and v"] == G * 16
    assert one.time.step_s < host.time.step_s


def test_a_speculative_update_of_the_lowest_host_layer_hides_behind_the_device_layers_backward():
    """With K layers below it updating on the device, the last host-updated layer's gradient lands with K layers'
    backward still to run: its speculative update is hidden by that much (the term is zero here), and with no
    device layer below it, not (the control)."""
    from megatrain.costs.residency import Residency as R
    from megatrain.planner import plan
    from megatrain.planner.step_time import IDLE_LAYERS_SPECULATIVE

    hidden = plan("llama2-7b", 4096, 1, hardware="h200-pcie", residency=R(32, 32, 29), speculative_step=True)
    assert hidden.time.idle_s[IDLE_LAYERS_SPECULATIVE] == 0
    exposed = plan("llama2-7b", 4096, 1, hardware="h200-pcie", residency=R(32, 0, 0), speculative_step=True)
    assert exposed.time.idle_s[IDLE_LAYERS_SPECULATIVE] > 0


def test_the_search_tries_the_globals_on_the_device_where_the_engines_fill_keeps_no_optimizer_there():
    """qwen2.5-32b on an H200 at 4 x 4096: the engine's "auto" leaves room for a batch of the model's whole context
    window and keeps no optimizer on the device; the planner's search also replays one layer's optimizer (the
    resident parameters' with it) along the graphs' frontier, and that wins: their update leaves the launch thread.
    Where the engine refuses optimizer residency (the optimizer in backward), no such placement is tried."""
    from megatrain.planner import plan
    from megatrain.planner.step_time import IDLE_RESIDENT

    pl = plan("qwen2.5-32b", 4096, 4, hardware="h200-pcie")
    assert pl.placement.engine.optimizer == 0 and pl.long_context.residency.optimizer == 1
    assert pl.time.idle_s[IDLE_RESIDENT] == 0
    assert pl.time.step_s < pl.placement.replayed[pl.placement.engine][0]
    refused = plan("qwen2.5-32b", 4096, 4, hardware="h200-pcie", optimizer_in_backward=True)
    assert refused.placement is not None and all(r.optimizer == 0 for r in refused.placement.replayed)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_globals_state_lives_and_updates_there():
    """On a GPU (bf16 compute, hilo): the globals' master, slab and Adam state are CUDA tensors, no upload is built
    and no gradient copy of theirs is traced; the training follows the host path's (the same first loss: the same
    weights; FP32 masters after two steps within 1e-4 relative, fused CUDA against fused CPU AdamW)."""
    mode = {"compute_dtype": "bfloat16", "host_master": "hilo", "device": "cuda"}
    batches = make_batches(MICRO)
    runs = {}
    for k in (0, 1):
        eng, sched = _engine(0, k, mode, False, trace=True)
        losses, _ = _steps(eng, sched, batches, 2)
        runs[k] = (eng, losses)
    eng, losses = runs[1]
    assert eng.globals_on_device and eng.placement.upload is None
    assert eng.store.globals.master.is_cuda and eng.store.globals.grad.is_cuda
    assert all(t.is_cuda for t in _globals_adam(eng)[1::3])
    assert not any(r.kind in ("head-grad", "embed-grad") for r in eng.trace)
    host, host_losses = runs[0]
    assert any(r.kind == "head-grad" for r in host.trace)  # the control: the host path copies them down
    assert losses[0] == host_losses[0]
    a, b = (torch.cat([p.detach().float().cpu().flatten() for p in e.store.globals.params]) for e in (eng, host))
    assert float((a - b).norm() / b.norm()) < 1e-4
