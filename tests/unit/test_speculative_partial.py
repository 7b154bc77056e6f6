"""Partial speculation: speculative_step "auto" speculates the first host-updated layers whose rollback copies fit the
host memory left (engine/update/speculative.py resolve, engine/host/preflight.py rollback_layers), the rest updated
at step() as without speculation. Every check is against the serial path (`optimizer_overlap=False,
speculative_step=False`): losses, pre-clip norms, weights and Adam state the same bits, with a clip that scales
(rolled back, counted) or never does, with accumulation. The count comes from a patched free host memory; the
negative control: the old all-or-nothing measure of the same memory gives no layer at all.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from conftest import make_batches, tiny_model
from gpu_defaults import CONFIGS, lag_updates
from kit import assert_same_training_state, settle_speculation, train_steps

import megatrain.engine.host.preflight as preflight
from megatrain.config.schema import IF_FITS, EngineConfig
from megatrain.costs.modes import rollback_bytes_per_param
from megatrain.costs.rollback import ROLLBACK_HEADROOM_BYTES
from megatrain.engine import Engine
from megatrain.engine.host.preflight import HostMemoryError, rollback_layers, rollback_preflight
from megatrain.engine.update import speculative
from megatrain.engine.update.speculative import Speculative

LINK_GBPS = 0.05
LAYERS = 4


def _room(eng: Engine, fit: int) -> tuple[list[int], int, int]:
    """(the layers' sizes, bytes per parameter of a copy, free host bytes that hold `fit` copies, a byte short of
    the next)."""
    numels = [g.numel for g in eng.store.layers]
    per = rollback_bytes_per_param(eng.store.master_mode, eng.config.compute_dtype == "bfloat16")
    return numels, per, per * sum(numels[: fit + 1]) - 1


def _reserve(eng: Engine) -> int:
    """What the host's free memory must hold beside the copies when "auto" sizes them: the headroom kept, the slabs'
    pages and the Adam state to come (tests/unit/test_speculative_host_memory.py)."""
    return ROLLBACK_HEADROOM_BYTES + speculative.state_to_come_bytes(eng.store, eng.optimizer)


def _partial(monkeypatch: pytest.MonkeyPatch, mode: dict, fit: int, **cfg) -> tuple[Engine, Engine, int]:
    """The serial engine, and one whose "auto" is settled as on CUDA (IF_FITS) with the host's free memory patched
    to hold `fit` layers' copies."""
    base = tiny_model("llama", layers=LAYERS)
    serial = Engine(copy.deepcopy(base), EngineConfig(**{**mode, "optimizer_overlap": False,
                                                         "speculative_step": False, "link_gbps": LINK_GBPS}))
    numels, per, free = _room(serial, fit)
    resolve = speculative.resolve

    def as_on_cuda(config: EngineConfig, *a, **k) -> frozenset[int]:
        with monkeypatch.context() as m:  # the free memory the rollback measure reads (not the store's preflight)
            m.setattr(preflight, "available_host_bytes", lambda: free + _reserve(serial))
            return resolve(dataclasses.replace(config, speculative_step=IF_FITS), *a, **k)

    monkeypatch.setattr(speculative, "resolve", as_on_cuda)
    spec = lag_updates(Engine(copy.deepcopy(base), EngineConfig(**{**mode, **cfg, "link_gbps": LINK_GBPS})))
    return serial, spec, free




@pytest.mark.parametrize("overlap", [False, True], ids=["serial-step", "overlap"])
@pytest.mark.parametrize("clip,accum,settle", [(0.05, 1, True), (1e6, 1, True), (0.05, 2, True), (1e6, 1, False)],
                         ids=["clip-scales", "clip-never", "accum", "racing"])
@pytest.mark.parametrize("mode", CONFIGS)
def test_auto_speculates_the_first_layers_that_fit_bit_for_bit(monkeypatch, mode, clip, accum, settle, overlap):
    """`settle`: the speculations done before each step (else the step overtakes what it finds not started, the
    layers put off included, and how many ran is timing's)."""
    fit, steps = 2, 3
    serial, spec, free = _partial(monkeypatch, mode, fit, optimizer_overlap=overlap)
    assert isinstance(spec.update, Speculative) and spec.config.speculative_step is True
    assert spec.update.layers == frozenset(range(fit))
    # the negative control: the whole-model measure of the same free memory turns it off
    numels, _, _ = _room(serial, fit)
    assert not rollback_preflight(sum(numels), spec.store.master_mode, spec.config.compute_dtype == "bfloat16",
                                  required=False, available=free)
    batches = make_batches(steps * accum)
    a = train_steps(serial, batches, steps, accum=accum, clip=clip)
    b = train_steps(spec, batches, steps, accum=accum, clip=clip, after_backward=settle_speculation if settle else None)
    assert a == b
    assert_same_training_state(serial, spec)
    stats = spec.collect_stats()
    assert stats["speculative_layers"] == fit and serial.collect_stats()["speculative_layers"] == 0
    if clip < 1:
        assert all(n > clip for n in a[1]), a[1]  # the clip scales at every step: every speculation undone
        assert stats["speculative_rollbacks"] >= steps
    else:
        assert stats["speculative_rollbacks"] == 0
        # every speculated layer's update kept (one put off is taken by the lowest layer's job, done before step())
        assert spec.update.kept_layers == steps * fit or not settle
    # only the speculated layers hold a copy (the rollback memory is theirs); the lowest is never passed over
    held = [c.nbytes > 0 for c in spec.update.copies]
    assert (held[0] or not settle) and not any(held[fit:])


@pytest.mark.parametrize("pass_over", [True, False])
def test_behind_backward_the_lowest_landed_layer_goes_first(monkeypatch, pass_over):
    """The host held until every gradient has landed: each speculation but the lowest finds the next layer down landed
    and is put off; the lowest layer's job then takes them lowest first, so the host runs them in forward order
    (the control: without putting off, in landing order), bit for bit as the serial step."""
    import threading

    from megatrain.engine.update.speculative import StateCopy

    fit, steps = 3, 2
    serial, spec, _ = _partial(monkeypatch, CONFIGS[0].values[0], fit)
    spec.update.pass_over = pass_over
    order: list[int] = []
    save = StateCopy.save

    def saving(self, group, view, *room) -> bool:
        order.append(next(i for i, g in enumerate(spec.store.layers) if g is group))
        return save(self, group, view, *room)

    monkeypatch.setattr(StateCopy, "save", saving)
    gate = threading.Event()
    begin = spec.update.begin_backward

    def begin_then_hold() -> None:
        begin()
        gate.clear()
        spec.update.layered.stream.submit(lambda: (gate.wait(5), 0)[1], (), "hold", 0)  # ahead of every speculation

    spec.update.begin_backward = begin_then_hold

    def release(eng: Engine) -> None:
        if eng is spec:
            eng.events.wait_grads()  # every gradient landed
            gate.set()
            settle_speculation(eng)

    batches = make_batches(steps)
    a = train_steps(serial, batches, steps, clip=1e6)
    b = train_steps(spec, batches, steps, clip=1e6, after_backward=release)
    assert a == b
    assert_same_training_state(serial, spec)
    assert order == steps * (list(range(fit)) if pass_over else list(range(fit))[::-1])
    assert spec.update.passed_over == (steps * (fit - 1) if pass_over else 0)
    assert spec.update.kept_layers == steps * fit


def test_only_the_speculated_layers_move_before_step(monkeypatch):
    fit = 1
    serial, spec, _ = _partial(monkeypatch, CONFIGS[0].values[0], fit)
    batch = make_batches(1)[0]
    before = [g.master.clone() for g in spec.store.layers]
    for eng in (serial, spec):
        eng.backward(eng(**batch).loss)
    spec.update.layered.synchronize()
    moved = [not torch.equal(g.master, b) for g, b in zip(spec.store.layers, before)]
    assert moved == [i < fit for i in range(LAYERS)]
    for eng in (serial, spec):
        eng.step()
    assert_same_training_state(serial, spec)
    assert spec.update.kept_layers == fit


def test_the_count_skips_device_layers_and_true_needs_every_host_layer(monkeypatch):
    eng = Engine(tiny_model("llama", layers=LAYERS))
    numels, per, free = _room(eng, 2)
    monkeypatch.setattr(preflight, "available_host_bytes", lambda: free + _reserve(eng))
    cuda = torch.device("cuda")
    auto = dataclasses.replace(eng.config, speculative_step=IF_FITS)
    assert speculative.resolve(auto, cuda, eng.optimizer, eng.store, False) == {0, 1}
    # an optimizer-resident layer is updated on the device: the count starts at the first host-updated one
    assert speculative.resolve(auto, cuda, eng.optimizer, eng.store, False, frozenset({0})) == {1, 2}
    assert rollback_layers(numels, eng.store.master_mode, False, required=False, available=free) == 2
    assert rollback_layers(numels, eng.store.master_mode, False, required=False, available=per * numels[0] - 1) == 0
    with pytest.raises(HostMemoryError, match="room for 2 of 4 layers"):
        speculative.resolve(EngineConfig(speculative_step=True), cuda, eng.optimizer, eng.store, False)
    assert speculative.resolve(EngineConfig(speculative_step=False), cuda, eng.optimizer, eng.store, False) == set()


def test_a_copy_that_no_longer_fits_stops_its_layer_speculating_same_bits(monkeypatch, caplog):
    """The count is measured when the engine is built; what the first batches allocate afterwards can take the room.
    Each first copy checks the host again: where it no longer fits, its layer is updated at step() for good (the
    serial step's bits), said once; the control (below): with room, both layers keep speculating."""
    fit, steps = 2, 2
    serial, spec, _ = _partial(monkeypatch, CONFIGS[0].values[0], fit)
    monkeypatch.setattr(preflight, "available_host_bytes", lambda: ROLLBACK_HEADROOM_BYTES)
    batches = make_batches(steps)
    with caplog.at_level("WARNING", logger="megatrain"):
        a = train_steps(serial, batches, steps, clip=1e6)
        b = train_steps(spec, batches, steps, clip=1e6, after_backward=settle_speculation)
    assert a == b
    assert_same_training_state(serial, spec)
    assert spec.update.layers == frozenset() and spec.collect_stats()["speculative_layers"] == 0
    assert spec.update.kept_layers == 0 and all(c.nbytes == 0 for c in spec.update.copies)
    assert sum("no longer fits" in r.getMessage() for r in caplog.records) == 1


def test_with_room_every_counted_layer_keeps_speculating(monkeypatch):
    fit = 2
    serial, spec, _ = _partial(monkeypatch, CONFIGS[0].values[0], fit)
    batches = make_batches(2)
    assert train_steps(serial, batches, 2, clip=1e6) == train_steps(spec, batches, 2, clip=1e6, after_backward=settle_speculation)
    assert spec.update.layers == frozenset(range(fit)) and spec.update.kept_layers == 2 * fit
