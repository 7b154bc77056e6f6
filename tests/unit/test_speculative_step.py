"""speculative_step: each layer's host update during backward, kept or rolled back at step(), bit for bit.

Every check is against the serial path (`optimizer_overlap=False, speculative_step=False`) on the same model and
batches, over an emulated link (copies on their own thread at a set rate) with the optimizer thread slowed, so
the speculative updates run behind the caller: losses, pre-clip norms, weights and Adam state must be the same
bits. A clip that scales, a non-finite gradient and an accumulation's extra backward each roll the speculation
back (counted); a clip that never scales keeps it (no rollback). The controls: restoring nothing must change the
weights, and a speculation kept through a clip must too.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_batches, tiny_model
from gpu_defaults import CONFIGS, lag_updates
from kit import assert_same_training_state, settle_speculation, train_steps

from megatrain.config.schema import EngineConfig
from megatrain.engine import Engine
from megatrain.engine.host.preflight import HostMemoryError, rollback_preflight
from megatrain.engine.update import speculative
from megatrain.engine.update.speculative import Speculative, StateCopy

LINK_GBPS = 0.05


def _engines(mode: dict, **cfg):
    base = tiny_model("llama", layers=3)
    serial = Engine(copy.deepcopy(base), EngineConfig(**{**mode, **cfg, "optimizer_overlap": False,
                                                         "speculative_step": False, "link_gbps": LINK_GBPS}))
    spec = lag_updates(Engine(copy.deepcopy(base), EngineConfig(**{**mode, **cfg, "speculative_step": True,
                                                                   "link_gbps": LINK_GBPS})))
    assert isinstance(spec.update, Speculative) and not isinstance(serial.update, Speculative)
    # The optimizer thread lags, so a lower layer has always landed when a speculation starts: every one is run
    # here (the layers the speculation passes over when behind: tests/unit/test_speculative_partial.py).
    spec.update.pass_over = False
    return serial, spec


def _train(eng: Engine, batches, steps: int, clip: float | None, accum: int = 1, poison: int | None = None,
           settle: bool = True):
    """Losses and pre-clip norms; at step `poison` the embedding's gradient gets a NaN (a non-finite step).
    `settle`: the speculative updates are done before the step (else a job the step overtakes leaves its layer to
    the step, so how many were speculated depends on timing)."""
    def poisoned(eng: Engine, s: int) -> None:
        if s == poison:
            eng.events.wait_global_grads()
            eng.store.globals.grad[0] = float("nan")

    return train_steps(eng, batches, steps, accum=accum, clip=clip, after_backward=settle_speculation if settle else None,
                       before_clip=poisoned)




@pytest.mark.parametrize("settle", [True, False], ids=["settled", "racing"])
@pytest.mark.parametrize("mode", CONFIGS)
def test_a_clip_that_scales_rolls_back_and_redoes_bit_for_bit(mode, settle):
    serial, spec = _engines(mode)
    batches = make_batches(4)
    a = _train(serial, batches, 4, clip=0.05)
    b = _train(spec, batches, 4, clip=0.05, settle=settle)
    assert all(n > 0.05 for n in a[1]), a[1]  # the clip scales at every step
    assert a == b
    assert_same_training_state(serial, spec)
    assert serial.collect_stats()["speculative_rollbacks"] == 0
    if settle:
        assert spec.collect_stats()["speculative_rollbacks"] == 4


def test_without_a_link_emulated_the_kept_layers_are_the_host_copies_and_still_exact():
    """No link emulated on a CPU device: a kept layer's "device copy" is its host master itself (pipeline.alias_kept),
    so the speculative update writes what backward's other layers never read again."""
    base = tiny_model("llama", layers=3)
    serial = Engine(copy.deepcopy(base), EngineConfig(optimizer_overlap=False, speculative_step=False))
    spec = lag_updates(Engine(copy.deepcopy(base), EngineConfig(speculative_step=True)))
    assert spec.pipeline.alias_kept
    batches = make_batches(4)
    assert _train(serial, batches, 4, clip=0.05) == _train(spec, batches, 4, clip=0.05, settle=False)
    assert_same_training_state(serial, spec)


@pytest.mark.parametrize("mode", CONFIGS)
def test_a_clip_that_never_scales_keeps_every_speculation(mode):
    serial, spec = _engines(mode)
    batches = make_batches(4)
    a = _train(serial, batches, 4, clip=1e6)
    b = _train(spec, batches, 4, clip=1e6)
    assert a == b
    assert_same_training_state(serial, spec)
    assert spec.collect_stats()["speculative_rollbacks"] == 0
    assert spec.update.kept_layers == 4 * len(spec.store.layers)  # every layer update was the speculative one


def test_each_layer_is_updated_during_backward_before_step():
    serial, spec = _engines(CONFIGS[0].values[0])
    batch = make_batches(1)[0]
    before = {k: v.clone() for k, v in spec.state_dict().items()}
    for eng in (serial, spec):
        eng.backward(eng(**batch).loss)
    spec.update.layered.synchronize()  # the optimizer thread's jobs done, nothing restored (not spec.synchronize())
    assert all(v is not None for v in spec.update.speculated)
    layer = [k for k in before if ".layers." in k]
    moved = [k for k in layer if not torch.equal(spec.store.layers[int(k.split(".")[2])].read_slot(
        next(s for s in spec.store.layers[int(k.split(".")[2])].slots if s.name == k.split(".", 3)[3])), before[k])]
    assert moved == layer  # every layer parameter updated before step()
    for eng in (serial, spec):
        eng.step()
    assert_same_training_state(serial, spec)
    assert spec.update.kept_layers == len(spec.store.layers)


@pytest.mark.parametrize("change", ["lr", "grad"])
def test_a_changed_lr_or_hand_written_gradient_rolls_back(change):
    serial, spec = _engines(CONFIGS[0].values[0])
    batches = make_batches(2)
    for batch in batches:
        for eng in (serial, spec):
            eng.backward(eng(**batch).loss)
            # The speculative updates done first (a write racing them is the caller's: Engine.synchronize() would
            # undo them all), so the checks at step() are what find the LR or layer 1's slab changed.
            (eng.update.layered.synchronize if eng is spec else eng.events.wait_grads)()
            if change == "lr":
                eng.optimizer.param_groups[0]["lr"] *= 0.5
            else:
                eng.store.layers[1].params[0].grad.mul_(0.5)  # only layer 1's update is redone
            eng.step()
            eng.zero_grad()
    assert_same_training_state(serial, spec)
    assert spec.collect_stats()["speculative_rollbacks"] == 2
    kept = 0 if change == "lr" else 2 * (len(spec.store.layers) - 1)
    assert spec.update.kept_layers == kept


@pytest.mark.parametrize("mode", CONFIGS)
def test_a_non_finite_step_is_skipped_and_the_layers_restored(mode):
    serial, spec = _engines(mode)
    batches = make_batches(4)
    with pytest.warns(UserWarning, match="non-finite"):
        a = _train(serial, batches, 4, clip=None, poison=2)
    with pytest.warns(UserWarning, match="non-finite"):
        b = _train(spec, batches, 4, clip=None, poison=2)
    assert a == b
    assert serial.skipped_steps == spec.skipped_steps == 1
    assert_same_training_state(serial, spec)
    assert spec.collect_stats()["speculative_rollbacks"] == 1


def test_a_non_finite_first_step_leaves_no_adam_state():
    """The first step's update creates Adam's state: skipped, the state is absent again, as the serial path has it."""
    serial, spec = _engines(CONFIGS[0].values[0])
    batches = make_batches(2)
    with pytest.warns(UserWarning, match="non-finite"):
        _train(serial, batches, 1, clip=None, poison=0)
    with pytest.warns(UserWarning, match="non-finite"):
        _train(spec, batches, 1, clip=None, poison=0)
    spec.synchronize()
    assert not any(spec.optimizer.state.values()) and not any(serial.optimizer.state.values())
    assert_same_training_state(serial, spec)
    _train(serial, batches[1:], 1, clip=None)
    _train(spec, batches[1:], 1, clip=None)
    assert_same_training_state(serial, spec)


def test_accumulation_speculates_on_the_last_backward_only():
    serial, spec = _engines(CONFIGS[0].values[0])
    batches = make_batches(8)
    a = _train(serial, batches, 4, clip=1e6, accum=2)
    b = _train(spec, batches, 4, clip=1e6, accum=2)
    assert a == b
    assert_same_training_state(serial, spec)
    # The first step's first backward speculated (no count learnt yet) and its second undid that; then none.
    assert spec.collect_stats()["speculative_rollbacks"] == 1


def test_a_read_between_backward_and_step_sees_the_weights_before_the_step():
    serial, spec = _engines(CONFIGS[0].values[0])
    batch = make_batches(1)[0]
    for eng in (serial, spec):
        eng.backward(eng(**batch).loss)
    assert all(torch.equal(x, y) for x, y in zip(serial.state_dict().values(), spec.state_dict().values()))
    assert spec.collect_stats()["speculative_rollbacks"] == 1
    for eng in (serial, spec):
        eng.step()
    assert_same_training_state(serial, spec)


def test_controls_a_missing_restore_or_a_kept_speculation_changes_the_weights(monkeypatch):
    batches = make_batches(2)
    serial, spec = _engines(CONFIGS[0].values[0])
    _train(serial, batches, 2, clip=0.05)
    monkeypatch.setattr(StateCopy, "restore", lambda self, group, view: None)
    _train(spec, batches, 2, clip=0.05)
    with pytest.raises(AssertionError, match="differ"):
        assert_same_training_state(serial, spec)
    monkeypatch.undo()
    serial, spec = _engines(CONFIGS[0].values[0])
    _train(serial, batches, 2, clip=0.05)
    monkeypatch.setattr(speculative, "_hyper", lambda optimizer: [])  # keep the speculation through the clip too
    monkeypatch.setattr(spec.clipping, "layer_coefs", lambda: [])
    _train(spec, batches, 2, clip=0.05)
    with pytest.raises(AssertionError, match="differ"):
        assert_same_training_state(serial, spec)


def test_settings_and_the_rollback_preflight():
    model = tiny_model("llama", layers=2)
    assert Engine(copy.deepcopy(model)).config.speculative_step is False  # "auto" on a CPU device: off
    with pytest.raises(ValueError, match="speculative_step='maybe'"):
        EngineConfig(speculative_step="maybe")
    with pytest.raises(ValueError, match="optimizer_in_backward"):
        EngineConfig(speculative_step=True, optimizer_in_backward=True)
    sgd = lambda named: torch.optim.SGD([p for _, p in named], lr=0.1)  # noqa: E731
    with pytest.raises(ValueError, match="speculative_step=True: SGD"):
        Engine(copy.deepcopy(model), EngineConfig(speculative_step=True), optimizer=sgd)
    from megatrain.costs.modes import HostMaster

    assert rollback_preflight(1000, HostMaster.FP32, True, required=True, available=14_000)
    assert not rollback_preflight(1000, HostMaster.FP32, True, required=False, available=13_999)
    with pytest.raises(HostMemoryError, match="rollback copy"):
        rollback_preflight(1000, HostMaster.HILO, True, required=True, available=11_999)


def test_a_step_that_overtakes_the_speculation_updates_the_layers_itself():
    """Speculative jobs not started when step() comes copy nothing: the step's own jobs update those layers."""
    import threading

    serial, spec = _engines(CONFIGS[0].values[0], optimizer_overlap=True)  # step() returns before the layer jobs
    gate = threading.Event()
    begin = spec.update.begin_backward

    waited: list[bool] = []

    def blocker() -> int:
        waited.append(not gate.wait(5))  # True: nothing opened the gate, so step() waited for this thread
        return 0

    def begin_then_block() -> None:
        begin()
        spec.update.layered.stream.submit(blocker, (), "block", 0)  # ahead of every speculation

    spec.update.begin_backward = begin_then_block
    batch = make_batches(1)[0]
    for eng in (serial, spec):
        eng.backward(eng(**batch).loss)
        eng.clip_grad_norm_(1e6)
        eng.step()
    gate.set()
    assert_same_training_state(serial, spec)
    assert waited == [False], "step() waited for the speculative jobs"
    assert spec.update.kept_layers == 0 and spec.collect_stats()["speculative_rollbacks"] == 0


def test_too_many_bad_steps_leave_the_weights_of_the_last_good_one():
    """step() raises before any verdict: what is read after it (a checkpoint) is the last good step's."""
    serial, spec = _engines(CONFIGS[0].values[0], max_bad_steps=1)
    batch = make_batches(1)[0]
    for eng in (serial, spec):
        eng.backward(eng(**batch).loss)
        settle_speculation(eng)
        eng.events.wait_global_grads()
        eng.store.globals.grad[0] = float("nan")
        with pytest.raises(FloatingPointError, match="consecutive"):
            eng.step()
    assert_same_training_state(serial, spec)
    assert spec.collect_stats()["speculative_rollbacks"] == 1


@pytest.mark.parametrize("mode", CONFIGS)
def test_the_copies_hold_the_bytes_the_preflight_counts(mode):
    from megatrain.costs.modes import HostMaster, rollback_bytes_per_param

    serial, spec = _engines(mode)
    _train(spec, make_batches(2), 2, clip=None)
    per_param = rollback_bytes_per_param(HostMaster(spec.config.host_master), spec.config.compute_dtype == "bfloat16")
    assert per_param == 12  # an FP32 master computing in FP32, or hilo's halves: 4 B, and m and v 8 B
    numel = sum(g.numel for g in spec.store.layers)
    steps = sum(len(g.slots) for g in spec.store.layers)  # Adam's step counter: one 4-byte tensor per parameter
    assert sum(c.nbytes for c in spec.update.copies) == per_param * numel + 4 * steps
    assert rollback_bytes_per_param(HostMaster.FP32, True) == 14 and rollback_bytes_per_param(HostMaster.BF16, True) == 10


def test_auto_is_on_for_a_cuda_device_with_adamw_where_the_copy_fits(monkeypatch):
    eng = Engine(tiny_model("llama", layers=2))
    from megatrain.config.schema import IF_FITS
    from megatrain.config.settle import EngineFacts, settle_engine

    # "auto" is settled for the device and the optimizer by the config (settle_engine); the engine measures the fit
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    cfg, cpu_cfg = (settle_engine(EngineConfig(), EngineFacts(d))[0] for d in ("cuda", "cpu"))
    adamw = eng.optimizer
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    assert EngineConfig().speculative_step == "auto" and cfg.speculative_step == IF_FITS
    assert cpu_cfg.speculative_step is False
    assert speculative.resolve(cfg, cuda, adamw, eng.store, data_parallel=False)
    assert not speculative.resolve(cpu_cfg, cpu, adamw, eng.store, data_parallel=False)
    assert not speculative.resolve(cfg, cuda, sgd, eng.store, data_parallel=False)
    assert speculative.resolve(cfg, cuda, adamw, eng.store, data_parallel=True)  # several ranks speculate too
    in_backward = settle_engine(EngineConfig(optimizer_in_backward=True), EngineFacts("cuda"))[0]
    assert not speculative.resolve(in_backward, cuda, adamw, eng.store, False)
    # where the copy does not fit beside the store: off, or refused when asked for
    import megatrain.engine.host.preflight as preflight

    monkeypatch.setattr(preflight, "available_host_bytes", lambda: 1000)
    assert not speculative.resolve(cfg, cuda, adamw, eng.store, data_parallel=False)
    with pytest.raises(HostMemoryError, match="speculative_step=True"):
        speculative.resolve(EngineConfig(speculative_step=True), cpu, adamw, eng.store, data_parallel=False)


def test_a_model_prepared_without_its_optimizer_does_not_speculate(monkeypatch):
    """The per-layer views are of the optimizer the engine is built with: a face that adopts one later turns "auto" off
    (here "auto" is made to say yes, as on CUDA)."""
    from megatrain.backend import MegatrainBackend

    monkeypatch.setattr(speculative, "resolve", lambda config, *a, **k: config.speculative_step is not False)
    backend = MegatrainBackend(config=EngineConfig(device="cpu", compute_dtype="float32", parity_probe=False),
                               mixed_precision=None)
    backend.prepare(tiny_model(layers=2, hidden=32, vocab=128), None)
    assert backend.engine.config.speculative_step is False and not isinstance(backend.engine.update, Speculative)
    assert backend.engine.config.written["speculative_step"] == "auto"
