"""The planner's speculative layer count is the engine's: planner/point.py speculative_layers sizes the rollback copies
with the same costs/rollback.py rollback_budget and counts them with the engine's own preflight.rollback_layers
(engine/update/speculative.py resolve), fed what the engine measures: the host's free memory once the store is built
(planner/memory.py's rows less the state still to come), the gradient slabs and Adam state to come, and the first
batch's host buffers. Across presets, host modes and host sizes (every GiB over a range that crosses each point's
boundary, where the budget's 1 GiB headroom decides a layer), the counts are equal."""

from __future__ import annotations

import dataclasses

import pytest

from megatrain.costs import rollback
from megatrain.costs.modes import HostMaster
from megatrain.engine.host import preflight
from megatrain.planner import plan
from megatrain.planner.hardware import GIB, get_hardware
from megatrain.planner.point import rollback_bytes, speculative_layers

# the host-memory rows planner/memory.py lists that the engine does not hold yet when resolve measures: the slabs'
# pages the first backward writes and the Adam state the first step creates (state_to_come_bytes) ...
TO_COME = ("gradients", "adam m", "adam v")
# ... and what the first batch allocates (after resolve, before the copies are filled)
FIRST_BATCH = ("offloaded activations", "offloaded graphs (residency)")

# (model, knobs, host sizes in GiB: a range across which the count steps)
POINTS = [
    ("qwen2.5-32b", dict(batch=4, hardware="gh200"), range(440, 680, 8)),
    ("qwen2.5-32b", dict(batch=4, hardware="gh200", host_master="hilo", host_grad_dtype="bfloat16"),
     range(440, 680, 8)),
    ("llama3.1-70b", dict(batch=1, hardware="h200-sxm"), range(2000, 2240, 8)),
    ("qwen3-30b-a3b", dict(batch=2, hardware="h100-sxm"), range(410, 700, 10)),  # MoE
]


def engine_count(name: str, kw: dict, host_gib: float) -> tuple[int, int]:
    """(the engine's count, the planner's) at this point on a host of `host_gib`: the engine's from its own
    functions on what it would measure, the planner's from speculative_layers."""
    hw = dataclasses.replace(get_hardware(kw["hardware"]), host_memory_gib=host_gib)
    on = plan(name, 4096, **{**kw, "hardware": hw})
    p, K = on.point, on.time.residency.optimizer
    # the same placement without the copies: every other row of the host's memory as the planner counts it
    off = plan(name, 4096, **{**kw, "hardware": hw, "speculative_step": False, "residency": on.time.residency})
    host = off.memory.host
    to_come = sum(host[k] for k in TO_COME)
    first_batch = sum(host[k] for k in FIRST_BATCH)
    free = hw.host_bytes - (off.memory.host_total - to_come - first_batch)
    budget = rollback.rollback_budget(free, to_come, first_batch)
    numels = p.model.layer_sizes()[K:]
    engine = preflight.rollback_layers(numels, HostMaster(p.host_master), p.c == 2, required=False, available=budget)
    planner = speculative_layers(p, hw, K, on.long_context.offload, on.long_context.offloaded_graph_host_bytes)
    return engine, planner


@pytest.mark.parametrize("name,kw,hosts", POINTS, ids=[f"{n}-{kw['hardware']}-{kw.get('host_master', 'auto')}"
                                                        for n, kw, _ in POINTS])
def test_the_planner_counts_the_copies_the_engine_would(name, kw, hosts):
    counts = []
    for gib in hosts:
        engine, planner = engine_count(name, kw, gib)
        assert planner == engine, (name, gib, planner, engine)
        counts.append(planner)
    assert len(set(counts)) > 2, counts  # the range crosses the count's steps, not one value throughout


def test_the_headroom_decides_a_layer_at_the_boundary():
    """Where the copies fit with less than the budget's headroom to spare, the engine takes one layer fewer; so does
    the planner (it counted the host's memory without that headroom: one layer more than the engine takes)."""
    name, kw, _ = POINTS[0]
    hw = get_hardware(kw["hardware"])
    on = plan(name, 4096, **kw)
    p, K = on.point, on.time.residency.optimizer
    n = speculative_layers(p, hw, K)
    per = rollback_bytes(p, 1, K)
    assert 0 < n < p.model.num_layers - K
    # the smallest host on which n + 1 copies fit, and half a headroom less
    extra = next(e / 8 for e in range(0, 8 * (per // GIB + 2))
                 if speculative_layers(p, dataclasses.replace(hw, host_memory_gib=hw.host_memory_gib + e / 8), K) > n)
    tight = dataclasses.replace(hw, host_memory_gib=hw.host_memory_gib + extra - 0.5 * rollback.ROLLBACK_HEADROOM_BYTES / GIB)
    engine, planner = engine_count(name, kw, tight.host_memory_gib)
    assert planner == engine == n


def test_one_headroom_moves_both(monkeypatch):
    """The planner reads the budget's rule where the engine does: a larger headroom lowers both counts alike."""
    name, kw, _ = POINTS[0]
    before = engine_count(name, kw, get_hardware(kw["hardware"]).host_memory_gib)
    monkeypatch.setattr(rollback, "ROLLBACK_HEADROOM_BYTES", 20 * GIB)
    after = engine_count(name, kw, get_hardware(kw["hardware"]).host_memory_gib)
    assert after[0] == after[1] < before[0] == before[1]
