"""Each layer's gradient norm measured by the job that lands its gradients, and zero_grad() left to the next
reduction (engine/host/slab_state.py): the same bits as reading and zeroing the slabs, with the step reading no layer
slab for its norm. Negative controls: a cached norm kept after a hand-written .grad, and a first add that adds
onto the last step's bytes instead of overwriting them, are each caught."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_batches, tiny_model
from kit import same_run, train_steps

from megatrain.config.schema import EngineConfig
from megatrain.engine import Engine
from megatrain.engine.host.slab_state import SlabState
from megatrain.engine.pipeline.schedule import accumulate

BATCHES = make_batches(6)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=3)


def _engine(model, overwrite: bool = True, **cfg) -> Engine:
    eng = Engine(copy.deepcopy(model), EngineConfig(**cfg))
    eng.events.slabs.overwrite = overwrite  # False: zero_grad() zeroes every slab, as before slab_state.py
    return eng


def _train(eng: Engine, steps: int = 3, accum: int = 2) -> tuple[list[float], dict[str, torch.Tensor]]:
    _, norms = train_steps(eng, BATCHES, steps, accum=accum, clip=0.05)
    eng.step()  # a step after zero_grad() with no backward: it must see zero gradients (AdamW still moves)
    return norms, eng.state_dict()


def _read_norm(eng: Engine) -> float:
    """The norm read from the slabs, as the engine computed it before slab_state.py."""
    eng.synchronize()
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.grad)
                                                       for g in eng.store.groups() if g.grad is not None])))


@pytest.mark.parametrize("overlap", [False, True], ids=["whole-step", "overlap"])
def test_overwriting_first_add_and_landed_norms_give_the_zeroing_engines_bits(model, overlap):
    want = _train(_engine(model, overwrite=False, optimizer_overlap=overlap))
    assert same_run(_train(_engine(model, optimizer_overlap=overlap)), want)


def test_negative_control_a_first_add_that_adds_onto_the_old_bytes_is_caught(model, monkeypatch):
    want = _train(_engine(model, overwrite=False))
    reduce = SlabState.reduce
    monkeypatch.setattr(SlabState, "reduce", lambda self, i, slab, add, measure:
                        reduce(self, i, slab, lambda first: add(False), measure))
    assert not same_run(_train(_engine(model)), want)


def test_zero_grad_makes_no_pass_and_the_step_reads_no_layer_slab_for_its_norm(model, monkeypatch):
    eng = _engine(model)
    eng.backward(eng(**BATCHES[0]).loss)
    eng.step()
    eng.zero_grad()
    eng.synchronize()
    layer_slabs = {g.grad.data_ptr() for g in eng.store.layers}
    assert all(g.grad.abs().sum() > 0 for g in eng.store.layers)  # not zeroed: the next backward overwrites
    assert all(p.grad is None for g in eng.store.layers for p in g.params)  # no stale bytes shown as .grad
    assert eng.grad_norm() == 0.0 == _zeroed_norm(eng)

    eng.backward(eng(**BATCHES[1]).loss)
    eng.synchronize()
    assert all(p.grad is not None for g in eng.store.layers for p in g.params)
    read: list[int] = []
    norm = torch.linalg.vector_norm
    monkeypatch.setattr(torch.linalg, "vector_norm", lambda x, *a, **k: (read.append(x.data_ptr()), norm(x, *a, **k))[1])
    got = eng.grad_norm()
    assert read and not layer_slabs & set(read)  # only the resident parameters' slab is read
    monkeypatch.setattr(torch.linalg, "vector_norm", norm)
    assert got == _read_norm(eng)


def _zeroed_norm(eng: Engine) -> float:
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(eng.store.globals.grad)]
                                                      + [torch.zeros(())] * len(eng.store.layers))))


def _norm_after_hand_scaling(model, first_norm: bool) -> tuple[float, float]:
    """A user halves the layers' .grad between backward and clipping: (the engine's norm, the slabs' norm)."""
    eng = _engine(model)
    eng.backward(eng(**BATCHES[0]).loss)
    if first_norm:
        eng.grad_norm()  # the engine's own float cache, taken before the hand-written change
    # As the API asks before touching .grad by hand: a reduction still landing (its norm measured after its add)
    # would race with the write below (seen once in a full suite: a norm off in the fifth digit).
    eng.synchronize()
    for g in eng.store.layers:
        for p in g.params:
            p.grad.mul_(0.5)
    return eng.grad_norm(), _read_norm(eng)


@pytest.mark.parametrize("first_norm", [False, True], ids=["landed-norms", "engine-norm"])
def test_a_hand_written_grad_between_backward_and_step_is_seen(model, first_norm):
    got, want = _norm_after_hand_scaling(model, first_norm)
    assert got == want


def test_negative_control_a_cached_norm_that_ignores_later_writes_is_caught(model, monkeypatch):
    monkeypatch.setattr(SlabState, "norm", lambda self, i, slab: self._norms[i][0] if self._norms[i] else None)
    got, want = _norm_after_hand_scaling(model, first_norm=False)
    assert got != want


def test_a_write_the_version_counter_misses_is_forgotten_on_request(model):
    eng = _engine(model)
    eng.backward(eng(**BATCHES[0]).loss)
    before = eng.grad_norm()
    for g in eng.store.layers:
        g.grad.data.mul_(0.5)  # .data: a counter of its own, not the slab's
    eng.grads_written()
    assert eng.grad_norm() == _read_norm(eng) != before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_overwrite_is_zero_plus_g_in_one_pass(dtype):
    src = torch.tensor([-0.0, 1.5, -2.25, 3.0] * 5, dtype=dtype)
    want = torch.zeros(src.numel())
    accumulate(want, src, torch.empty(8))
    got = torch.full((src.numel(),), 7.0)
    accumulate(got, src, torch.empty(8), overwrite=True)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # the bits: +0 where src holds -0
    assert not torch.signbit(got[src == 0]).any()


@pytest.mark.parametrize("cfg", [{"optimizer_overlap": True}, {"host_master": "hilo", "compute_dtype": "bfloat16"}],
                         ids=["fp32 overlap", "hilo"])
def test_a_norm_read_again_after_a_folded_clip_is_of_the_clipped_gradients(model, cfg):
    """A per-layer path leaves the clip pending on the FP32 slabs (the layers' and the resident parameters') until
    the update scales them; a norm read again in between (a .grad written by hand invalidates the cached one) is
    the norm of the clipped gradients, and after step() every slab holds the clipped gradients: the bits of a
    whole step's engine, which scaled its slabs in place."""
    def norms(eng: Engine) -> list[float]:
        eng.backward(eng(**BATCHES[0]).loss)
        first = eng.clip_grad_norm_(0.05)
        eng.store.layers[0].params[0].grad.mul_(1.0)  # a hand-written .grad: its slab's version moves
        second = eng.grad_norm()
        eng.step()  # the slabs then hold what a clip in place leaves (the resident parameters' too)
        eng.synchronize()  # (with overlap the layer updates are still queued)
        return [first, second, *[g.grad.float() for g in eng.store.groups()]]

    # The reference: the FP32 master stepped whole (an optimizer with a step hook is never split into layers).
    m = copy.deepcopy(model)
    opt = torch.optim.AdamW(m.parameters(), fused=True)
    opt.register_step_post_hook(lambda *a: None)
    ref_cfg = {k: v for k, v in cfg.items() if k not in ("optimizer_overlap", "host_master")}
    ref = norms(Engine(m, EngineConfig(**ref_cfg), optimizer=opt))
    got = norms(_engine(model, **cfg))
    assert got[:2] == ref[:2]
    assert got[1] < got[0] * 0.5  # the clip took effect: the second read is not the unclipped norm
    assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got[2:], ref[2:]))
