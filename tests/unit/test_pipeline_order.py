"""The layer pipeline's issue order is defined once (megatrain/costs/pipeline.py): the engine's LayerPipeline
runs it and the planner's simulator replays it. Both are checked against that one definition, over two
micro-batches so the layers still resident at the forward/backward turn and across micro-batches count."""

from __future__ import annotations

import pytest
from conftest import make_batches, tiny_model

from megatrain.config.schema import EngineConfig
from megatrain.costs import pipeline as order
from megatrain.costs.residency import Residency
from megatrain.engine import Engine
from megatrain.planner.pipeline_sim import LayerCosts, simulate_step
from megatrain.planner.point import make_point

MICRO_BATCHES = 2
STREAM = Residency(0, 0)


def defined(n_layers: int, k: int, r: Residency = STREAM) -> tuple[list[int], list[tuple[str, int]]]:
    """(layers in weight-copy order, (phase, layer) in compute order) as costs/pipeline.py defines them."""
    buffers = order.DeviceBuffers(k, r.kept)
    loads, computes = [], []
    for _ in range(MICRO_BATCHES):
        for steps in (order.forward_steps(buffers, n_layers, r.graphs),
                      order.backward_steps(buffers, n_layers, r.graphs)):
            for s in steps:
                if s.op == order.LOAD:
                    loads.append(s.layer)
                elif s.op in (order.FORWARD, order.FORWARD_KEEP, order.BACKWARD, order.BACKWARD_KEPT):
                    computes.append(("fwd" if s.op in (order.FORWARD, order.FORWARD_KEEP) else "bwd", s.layer))
    return loads, computes


def test_the_order_keeps_the_last_layers_resident_at_the_turn():
    loads, computes = defined(5, 2)
    # forward loads every layer; backward starts on the two still resident (4, 3), and so does the next
    # micro-batch's forward (0, 1)
    assert loads[:5] == [0, 1, 2, 3, 4] and loads[5:8] == [2, 1, 0] and loads[8:10] == [2, 3]
    assert computes[:10] == [("fwd", i) for i in range(5)] + [("bwd", i) for i in reversed(range(5))]


@pytest.mark.parametrize("r", [STREAM, Residency(2, 1), Residency(3, 1), Residency(5, 5)],
                         ids=["stream", "2-1", "3-1", "all"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_engine_issues_the_defined_order(k, r):
    n_layers = 5
    eng = Engine(tiny_model("llama", layers=n_layers), EngineConfig(trace=True, num_buffers=k, residency=r))
    for batch in make_batches(MICRO_BATCHES):
        eng.backward(eng(**batch).loss)
    eng.collect_stats()
    records = sorted(eng.trace, key=lambda r: r.t_start)
    loads = [r.layer for r in records if r.stream == "h2d" and r.kind == "load"]
    computes = [(r.kind, r.layer) for r in records if r.stream == "compute" and r.kind in ("fwd", "bwd")]
    assert (loads, computes) == defined(n_layers, k, r)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_planner_replays_the_defined_order(k):
    p = make_point("tiny", 64, 1, MICRO_BATCHES, "float32", num_buffers=k)
    costs = LayerCosts(fwd=1.0, bwd=2.0, load=0.5, act=0.0, grad=0.1, reduce=0.1, cuda=False)
    sim = simulate_step(p, costs, head=0.3)[0]
    loads = [layer for lane, kind, layer, _, _ in sim.spans if lane == "h2d" and kind == "load"]
    computes = [(kind, layer) for lane, kind, layer, _, _ in sim.spans if lane == "compute" and kind in ("fwd", "bwd")]
    assert (loads, computes) == defined(p.model.num_layers, k)


def test_kept_layers_are_refreshed_ahead_of_the_rings_prefetches():
    """The copy queue is one FIFO and a streamed layer's copy waits for that layer's host update: every stale kept
    layer's copy is issued before the first ring prefetch, in each step (the masters changed), so none waits
    behind them. The old order fetched the ring's window at layer 0 and kept layer 2 after it: 0, 1, 3, 4, 2."""
    buffers = order.DeviceBuffers(2, Residency(3, 1).kept)
    for _ in range(2):  # two steps: the kept copies are stale again after the optimizer's
        loads = [s.layer for s in order.forward_steps(buffers, 5, Residency(3, 1).graphs) if s.op == order.LOAD]
        assert loads == [0, 1, 2, 3, 4]
        list(order.backward_steps(buffers, 5, Residency(3, 1).graphs))
        buffers.invalidate()


def test_the_planner_replays_the_kept_layers_first():
    """The planner's simulator issues the same copies in the same order on its h2d lane (a streamed layer's copy
    starts after every kept layer's)."""
    p = make_point("tiny", 64, 1, MICRO_BATCHES, "float32", num_buffers=2)
    costs = LayerCosts(fwd=1.0, bwd=2.0, load=0.5, act=0.0, grad=0.1, reduce=0.1, cuda=False)
    r = Residency(3, 1)
    sim = simulate_step(p, costs, 0.3, residency=r)[0]
    loads = [layer for lane, kind, layer, _, _ in sim.spans if lane == "h2d" and kind == "load"]
    assert loads == defined(p.model.num_layers, 2, r)[0]
    assert loads[:p.model.num_layers] == list(range(p.model.num_layers))
