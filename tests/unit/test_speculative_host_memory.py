"""speculative_step "auto" sizes its rollback copies against the host memory left once the state exists: the gradient
slabs touched and Adam's state created (engine/update/speculative.py state_to_come_bytes), with the runtime's
headroom kept; a layer whose copy no longer fits at a later step frees the copy it had.

The host is emulated: its free memory (the reader the engine uses, preflight.available_host_bytes) drops by the
slabs once the engine is built (the first backward writes them), by Adam's state as torch creates it, and by the
rollback copies as they are allocated. It holds the store's state and the first `FIT` layers' copies, a byte short
of the next: resolving against the memory free while the engine is built (no slab touched, no Adam state) would
speculate every layer and overcommit the host by its second step.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import make_batches, tiny_model
from gpu_defaults import CONFIGS
from kit import settle_speculation, train_steps

import megatrain.engine.host.preflight as preflight
from megatrain.config.schema import IF_FITS, EngineConfig
from megatrain.costs.modes import rollback_bytes_per_param
from megatrain.costs.rollback import ROLLBACK_HEADROOM_BYTES
from megatrain.engine import Engine
from megatrain.engine.update import speculative
from megatrain.engine.update.speculative import Speculative, state_to_come_bytes

LAYERS, FIT = 4, 2
LINK_GBPS = 0.05  # a link emulated: the layers stream (a plain CPU device holds their optimizer on it)


def _used(eng: Engine) -> int:
    """What the emulated host has handed out beside what it had when the engine was built."""
    slabs = sum(g.grad.numel() * g.grad.element_size() for g in eng.store.groups() if g.grad is not None)
    # read on the optimizer thread too (the engine's free-memory reader), while a layer's update fills its state
    adam = sum(t.numel() * t.element_size() for st in list(eng.optimizer.state.values()) for t in list(st.values())
               if torch.is_tensor(t))
    copies = sum(c.nbytes for c in eng.update.copies) if isinstance(eng.update, Speculative) else 0
    return slabs + adam + copies


@pytest.mark.parametrize("mode", CONFIGS)
def test_auto_sizes_the_copies_after_the_slabs_and_adam_state(monkeypatch, mode):
    model = tiny_model("llama", layers=LAYERS)
    built: dict[str, Engine] = {}
    free = 0

    def emulated() -> int:
        return free - (_used(built["eng"]) if "eng" in built else 0)

    resolve = speculative.resolve

    def as_on_cuda(config: EngineConfig, *a, **k) -> frozenset[int]:
        return resolve(dataclasses.replace(config, speculative_step=IF_FITS), *a, **k)

    probe = Engine(model, EngineConfig(**{**mode, "speculative_step": False, "link_gbps": LINK_GBPS}))
    numels = [g.numel for g in probe.store.layers]
    per = rollback_bytes_per_param(probe.store.master_mode, probe.config.compute_dtype == "bfloat16")
    to_come = state_to_come_bytes(probe.store, probe.optimizer)
    train_steps(probe, make_batches(1), 1, clip=None)
    probe.synchronize()  # the step's layer updates done (with overlap they run on, creating Adam's state)
    assert _used(probe) == to_come  # the count is what the slabs and Adam's state (m, v, step) take
    free = ROLLBACK_HEADROOM_BYTES + to_come + per * sum(numels[: FIT + 1]) - 1
    monkeypatch.setattr(speculative, "resolve", as_on_cuda)
    monkeypatch.setattr(preflight, "available_host_bytes", emulated)
    eng = Engine(tiny_model("llama", layers=LAYERS), EngineConfig(**{**mode, "link_gbps": LINK_GBPS}))
    built["eng"] = eng
    assert isinstance(eng.update, Speculative)
    assert eng.update.layers == frozenset(range(FIT)), "sized against the memory free before the state existed"
    eng.update.pass_over = False  # every speculated layer runs (not left to the step): each takes its copy
    train_steps(eng, make_batches(3), 3, clip=0.05, after_backward=settle_speculation)
    eng.synchronize()
    # every copy taken fits beside the state with the headroom kept, and the speculated layers kept their copies
    assert _used(eng) <= free - ROLLBACK_HEADROOM_BYTES
    assert [c.nbytes > 0 for c in eng.update.copies] == [i < FIT for i in range(LAYERS)]
    assert eng.collect_stats()["speculative_layers"] == FIT


def test_a_layer_refused_at_a_later_step_frees_its_copy(monkeypatch):
    """The first step's copy (no Adam state yet: the master only) is allocated; at the second the copy grows by m and
    v, which no longer fit: the layer stops speculating and its first copy is freed, not kept."""
    monkeypatch.setattr(speculative, "resolve", lambda config, *a, **k: frozenset(range(2)))
    eng = Engine(tiny_model("llama", layers=2), EngineConfig(device="cpu", compute_dtype="float32",
                                                             optimizer_overlap=True, link_gbps=LINK_GBPS))
    assert isinstance(eng.update, Speculative)
    eng.update.pass_over = False  # every layer speculates, however far behind the host is
    first: list[int] = []

    def room() -> int:  # room for the first step's copies, none for a bigger one
        return ROLLBACK_HEADROOM_BYTES + (0 if first else 1 << 40)

    monkeypatch.setattr(preflight, "available_host_bytes", room)
    train_steps(eng, make_batches(1), 1, clip=None, after_backward=settle_speculation)
    eng.synchronize()
    first.extend(c.nbytes for c in eng.update.copies)
    assert all(first)
    train_steps(eng, make_batches(2), 1, start=1, clip=None, after_backward=settle_speculation)
    eng.synchronize()
    assert [c.nbytes for c in eng.update.copies] == [0, 0] and eng.update.speculative_layers == 0


def test_the_shared_budget_rule():
    """costs/rollback.py: the rule the engine sizes by (and the planner is to predict with)."""
    from megatrain.costs.rollback import layers_that_fit, rollback_budget

    per, numels = 12, [10, 10, 20]
    assert [layers_that_fit(numels, per, b) for b in (119, 120, 239, 240, 479, 480)] == [0, 1, 1, 2, 2, 3]
    assert layers_that_fit([10, 100, 10], per, 1000) == 1  # in order: the first that does not fit ends it
    gib = 1 << 30
    assert rollback_budget(10 * gib, 3 * gib, 2 * gib) == 10 * gib - 3 * gib - 2 * gib - ROLLBACK_HEADROOM_BYTES
