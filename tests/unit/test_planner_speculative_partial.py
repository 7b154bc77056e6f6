"""The planner's partial speculation (planner/point.py speculative_layers, step_time.py speculative_wait): how many
layers "auto" speculates where not every rollback copy fits, and the timeline it predicts, checked against a replay of
the engine's queue (engine/update/speculative.py: one host thread, speculations in landing order, the step's jobs in
forward order, the next forward waiting on each layer's)."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from megatrain.costs.rollback import ROLLBACK_HEADROOM_BYTES
from megatrain.planner import plan
from megatrain.planner.hardware import get_hardware
from megatrain.planner.point import (
    host_left_for_rollback,
    make_point,
    rollback_bytes,
    speculative_layers,
    speculative_on,
)
from megatrain.planner.step_time import IDLE_LAYERS, speculative_wait


def replay(u: float, u_s: float, b: float, f: float, L: int, K: int, speculated: set[int], overlap: bool,
           pass_over: bool = True) -> float:
    """Seconds the layer updates add to the step, from the engine's rules written as a timeline of the host thread:
    layer j's gradient lands (L - j) b into the last backward, which ends at L b with the step; the thread takes
    the speculations in landing order, each once landed and free, running it (u_s) unless the step came first or,
    `pass_over`, the next speculated layer down has landed (put off: the lowest layer's job takes those after its own,
    lowest first, while the step has not come); the step queues every host layer in forward order (one the
    speculation ran costs nothing); the next forward runs layer j once its update is done (below K: the device's)."""
    end = L * b
    lands = {j: (L - j) * b for j in speculated}
    free, ran, waiting = 0.0, set(), []
    for j in sorted(speculated, key=lambda j: lands[j]):
        start = max(free, lands[j])
        lower = max((i for i in speculated if i < j), default=None)
        if start >= end:
            continue
        if pass_over and lower is not None and lands[lower] <= start:
            waiting.append(j)
            continue
        free = start + u_s
        ran.add(j)
        if lower is None:
            for i in sorted(waiting):
                if free < end:
                    free += u_s
                    ran.add(i)
    done_at = {}
    free = max(free, end)
    for j in range(K, L):
        free += 0.0 if j in ran else u
        done_at[j] = free
    if not overlap:
        return free - end
    t = end
    for j in range(L):
        t = max(t, done_at.get(j, end)) + f
    return t - end - L * f


def _draw(rng: random.Random, keeps_pace: bool | None = None) -> tuple[float, float, float, float]:
    u, f = rng.uniform(0.2, 2.0), rng.uniform(0.2, 1.5)
    u_s = u * rng.uniform(1.0, 1.6)
    b = {None: rng.uniform(0.2, 3.0), True: rng.uniform(u_s, 3 * u_s), False: rng.uniform(0.2 * u_s, u_s)}[keeps_pace]
    return u, u_s, b, f


@pytest.mark.parametrize("overlap", [True, False])
def test_the_timeline_is_the_replay_of_the_engine_queue(overlap):
    rng = random.Random(0)
    for _ in range(400):
        L = rng.choice([4, 16, 64])
        K = rng.randint(0, L // 4)
        n = rng.randint(1, L - K)
        u, u_s, b, f = _draw(rng)
        want = replay(u, u_s, b, f, L, K, set(range(K, K + n)), overlap)
        got = speculative_wait(u, u_s, b, f, L, K, n, L - K, overlap)[0]
        assert got == pytest.approx(want, abs=1e-9), (L, K, n, u, u_s, b, f)


@pytest.mark.parametrize("overlap", [True, False])
def test_putting_off_hides_more_where_the_host_is_behind(overlap):
    """Where a speculation outlasts a layer's backward, taking the latest landed layer first (the rest lowest first
    after the last landing) never leaves more to wait for than taking them in landing order (where the verdict
    overtakes the lowest, which the next forward needs first), and with overlap less, often."""
    rng = random.Random(2)
    better = 0
    for _ in range(300):
        L = rng.choice([16, 64])
        K = rng.choice([0, 1, 2, L // 4, L // 2])
        u, u_s, b, f = _draw(rng, keeps_pace=False)
        every = set(range(K, L))
        over, in_order = (replay(u, u_s, b, f, L, K, every, overlap, pass_over=p) for p in (True, False))
        assert over <= in_order + 1e-9
        better += over < in_order - 1e-9
    assert better > 100 or not overlap


def test_the_first_layers_hide_the_most_where_the_host_keeps_pace():
    """With overlap, where a speculation takes no longer than a layer's backward (u_s <= b), the first n host layers
    are the n-layer set the replay finds best of every set (a control: the last n are worse somewhere)."""
    rng = random.Random(1)
    last_worse = 0
    for _ in range(60):
        L, K = 7, rng.randint(1, 2)  # K = 0: layer 0 lands as backward ends, never speculated before the step
        u, u_s, b, f = _draw(rng, keeps_pace=True)
        host = list(range(K, L))
        for n in range(1, len(host) + 1):
            waits = {c: replay(u, u_s, b, f, L, K, set(c), True) for c in itertools.combinations(host, n)}
            first = waits[tuple(host[:n])]
            assert first <= min(waits.values()) + 1e-12
            last_worse += waits[tuple(host[-n:])] > first + 1e-12
    assert last_worse


def test_auto_speculates_the_layers_whose_copies_fit_gh200_qwen32b():
    """The issue's point: not every copy fits beside the store, so "auto" was off (7.2% idle predicted); as many as fit
    speculate, the copies within the host memory planner/memory.py leaves, and the idle drops to at most 5%."""
    kw = dict(batch=4, hardware="gh200")
    on = plan("qwen2.5-32b", 4096, **kw)
    off = plan("qwen2.5-32b", 4096, speculative_step=False, **kw)
    p, hw, K = on.point, get_hardware("gh200"), on.time.residency.optimizer
    n = speculative_layers(p, hw, K)
    host = p.model.num_layers - K
    assert 0 < n < host and not speculative_on(p, hw)  # the all-or-nothing rule: none
    left = host_left_for_rollback(p, hw, K)
    assert n == left // rollback_bytes(p, 1)
    # memory.py's figure, at the same placement (without the step, the search places otherwise: offloaded graphs)
    same = plan("qwen2.5-32b", 4096, speculative_step=False, residency=on.time.residency, **kw)
    # less the headroom the engine's budget keeps (costs/rollback.py, the rule both size the copies by)
    assert left == pytest.approx(hw.host_bytes - same.memory.host_total - ROLLBACK_HEADROOM_BYTES, rel=1e-3)
    assert same.memory.host_total + rollback_bytes(p, n) <= hw.host_bytes
    assert on.timeline.gpu_idle_fraction <= 0.05 < off.timeline.gpu_idle_fraction
    assert on.time.busy_s["host rollback copy"] > 0
    assert IDLE_LAYERS in on.time.idle_s  # what is left: the layers not speculated


def test_the_count_follows_the_host_memory():
    p = make_point("qwen2.5-32b", 4096, batch=4, host_master="hilo", host_grad_dtype="bfloat16")
    hw = get_hardware("gh200")
    per = rollback_bytes(p, 1)
    counts = [speculative_layers(p, dataclasses.replace(hw, host_memory_gib=hw.host_memory_gib + extra), 1)
              for extra in (-60, 0, per / 2**30, 1000)]
    assert counts[0] == 0 and 0 < counts[1] and counts[2] == counts[1] + 1 and counts[3] == p.model.num_layers - 1
    assert speculative_layers(make_point("qwen2.5-32b", 4096, speculative_step=True), hw, 1) == 63  # as set
    assert speculative_layers(make_point("qwen2.5-32b", 4096, speculative_step=False), hw, 1) == 0
    assert speculative_layers(p, get_hardware("cpu")) == 0  # "auto" off on a CPU device
    # offloaded activations are allocated at the first batch, before the first backward fills the copies
    m = p.model
    offloaded = m.num_layers * p.tokens * m.hidden * p.c
    assert host_left_for_rollback(p, hw, 1) - host_left_for_rollback(p, hw, 1, offload=True) == offloaded
    assert speculative_layers(p, hw, 1, offload=True) < speculative_layers(p, hw, 1)
