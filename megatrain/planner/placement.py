"""The planner's residency search: for `residency: "auto"`, the placement of kept weights and kept graphs that
maximizes predicted throughput within the room the batch's working set leaves on the device.

The engine's own "auto" (costs/residency.py `plan`) fills that room with kept weights first, then graphs (after
the optimizer-resident layers it fixed when it was built, costs/memory.py `optimizer_layers`). That
is the best placement when the weight copies bind (a short batch on a slow link) but not always when compute
binds: a kept layer's weights then save copies the compute hid anyway, while a kept graph saves its layer's
recompute. Along the frontier of placements that fill the room (a kept graph needs its layer's weights kept:
activations <= weights), each candidate is replayed through the engine's pipeline (step_time.megatrain_time) and
the fastest wins; so are placements that trade some optimizer-resident layers for kept graphs
(`optimizer_trades`). So are placements that keep more graphs by offloading some of them (`offloaded`): their
saved activations cross the link each way instead of their layers being recomputed, which pays where the link
is fast beside the compute (NVLink-C2C) and not over PCIe; only where host memory holds them. Where a placement
beats the engine's fill by more than PREFER_ENGINE_WITHIN, the plan says so and its config section writes the
counts; otherwise the engine's "auto" runs as planned and nothing is written (the engine's "auto" never
offloads graphs: only counts do).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from ..costs import residency as kept
from .hardware import Hardware
from .memory import LongContext, megatrain_memory, optimizer_refused
from .point import Point
from .step_time import Time, megatrain_time

# Keep the engine's own "auto" unless a placement predicts a step shorter by more than this share: explicit
# counts are fixed for every batch of a run (the engine's "auto" follows each batch), so a gain inside the
# model's error is not worth writing down.
PREFER_ENGINE_WITHIN = 0.01
# Placements replayed along the frontier (both ends included): the step time changes smoothly along it, and
# every replay costs a millisecond or two, inside the largest-batch and mode searches that plan many points.
FRONTIER_SAMPLES = 9


@dataclass(frozen=True)
class Placement:
    """The residency search at one point: what the engine's "auto" would keep, what the planner keeps, and the
    step time of each placement replayed."""

    chosen: kept.Residency
    engine: kept.Residency  # the engine's fill order: kept weights first, then graphs
    # each placement replayed: (step seconds, host -> device bytes per step, recomputed layers per step)
    replayed: dict[kept.Residency, tuple[float, int, int]] = field(default_factory=dict)

    @property
    def differs(self) -> bool:
        return self.chosen != self.engine

    @property
    def step_s(self) -> dict[kept.Residency, float]:
        return {r: v[0] for r, v in self.replayed.items()}

    def to_dict(self) -> dict[str, object]:
        return {"chosen": self.chosen.to_dict(), "engine_auto": self.engine.to_dict(), "differs": self.differs,
                "candidates": [{**r.to_dict(), "step_s": s, "h2d_bytes_per_step": b, "recomputed_layers_per_step": n}
                               for r, (s, b, n) in self.replayed.items()]}


def frontier(lc: LongContext, optimizer: int | None = None) -> list[kept.Residency]:
    """The placements that fill the room, from the engine's fill (most weights) to the most graphs: for each
    count of graphs, as many kept weights as still fit (more kept weights never slow a step). `optimizer`: the
    optimizer-resident count every placement keeps (None: the engine's, fixed when it was built)."""
    L, engine = lc.n_layers, lc.residency
    if lc.residency_room is None or not lc.graphs_allowed or engine.activations >= min(engine.weights, L):
        return [engine]  # everything fits, or graphs cannot be kept, or every kept layer keeps its graph already
    out = []
    k = engine.optimizer if optimizer is None else optimizer
    for a in range(0 if optimizer is not None else engine.activations, L + 1):
        w = _most_weights(lc, a, k)
        if w < max(a, k):
            break
        out.append(kept.Residency(w, a, k))
    return out


def optimizer_trades(lc: LongContext, allowed: bool = True) -> list[kept.Residency]:
    """Placements that give up some of the engine's optimizer-resident layers for kept graphs: for a sample of
    counts below the engine's, every layer's weights and as many graphs as then fit. Each optimizer-resident layer
    saves the host's update and its copies; each graph its layer's recompute: which gains more is the replay's to
    say, not the bytes'. Where the engine keeps no optimizer on the device (its "auto" leaves the room for a batch
    of the model's whole context window) and the point `allowed` it, the other way too: a sample of the counts that
    fit beside every layer's weights (the resident parameters' state first), as many graphs as then fit, each
    count taking the resident parameters' update, upload and gradient copies off the host (resident.py
    place_globals)."""
    L, k = lc.n_layers, lc.residency.optimizer
    if lc.residency_room is None or lc.residency.activations >= L:
        return []
    if k:
        counts = sorted({round(i * k / (FRONTIER_SAMPLES - 1)) for i in range(FRONTIER_SAMPLES - 1)}, reverse=True)
        more_graphs = True
    elif allowed:
        room = lc.residency_room + lc.ring_bytes - L * lc.layer_bytes - lc.globals_state_bytes
        most = min(L, max(0, room // max(lc.optimizer_state_bytes, 1)) if room >= 0 else 0)
        counts = sorted({max(1, round(i * most / (FRONTIER_SAMPLES - 1))) for i in range(FRONTIER_SAMPLES)}) if most else []
        more_graphs = False
    else:
        return []
    out = []
    for opt in counts:
        room = lc.residency_room + lc.ring_bytes - L * lc.layer_bytes - lc.optimizer_bytes(opt)
        graphs = min(L, max(0, room // max(lc.graph_bytes, 1))) if lc.graphs_allowed else 0
        r = kept.Residency(L, graphs, opt)
        if (graphs > lc.residency.activations or not more_graphs) and lc.fits(r):
            out.append(r)
    return out


def _most_weights(lc: LongContext, graphs: int, optimizer: int = 0) -> int:
    if lc.fits(kept.Residency(lc.n_layers, min(graphs, lc.n_layers), min(optimizer, lc.n_layers))):
        return lc.n_layers
    room = (lc.residency_room or 0) - graphs * lc.graph_bytes - lc.optimizer_bytes(optimizer)
    return max(-1, min(lc.n_layers - 1, room // max(lc.layer_bytes, 1)))


def offloaded(lc: LongContext, r: kept.Residency, samples: int = 2) -> list[kept.Residency]:
    """Placements that keep more of `r`'s kept layers' graphs than fit on the device by offloading some: for
    `samples` graph counts above r's, evenly up to its kept weights, the fewest offloaded graphs that fit the
    device room (the kept graphs, or OFFLOADED_GRAPHS_IN_FLIGHT offloaded ones) and the host's. None where the room
    is not limited (every graph fits already) or the batch keeps no graphs."""
    if lc.residency_room is None or not lc.graphs_allowed or lc.graph_host_room is None or r.activations >= r.weights:
        return []
    gap = r.weights - r.activations
    out = []
    for graphs in sorted({r.activations + max(1, round(gap * i / samples)) for i in range(1, samples + 1)}):
        fit = next((kept.Residency(r.weights, graphs, r.optimizer, j) for j in range(1, graphs + 1)
                    if lc.fits(kept.Residency(r.weights, graphs, r.optimizer, j))), None)
        if fit is not None:
            out.append(fit)
    return out


def _sample(points: list[kept.Residency]) -> list[kept.Residency]:
    if len(points) <= FRONTIER_SAMPLES:
        return points
    last = len(points) - 1
    picks = sorted({round(i * last / (FRONTIER_SAMPLES - 1)) for i in range(FRONTIER_SAMPLES)})
    return [points[i] for i in picks]


def search(lc: LongContext, step_of: Callable[[kept.Residency], Time],
           optimizer_allowed: bool = True, trade_optimizer: bool = True) -> tuple[Placement, Time]:
    """The fastest placement on the sampled frontier (`step_of` replays one), the engine's fill kept unless
    another beats it by more than PREFER_ENGINE_WITHIN. `optimizer_allowed`: whether the point may put optimizer
    state on the device (optimizer_trades); `trade_optimizer` False: the optimizer-resident count is fixed (an
    engine built already asks for its batches: planner/advice.py)."""
    engine = lc.residency
    trades = optimizer_trades(lc, optimizer_allowed) if trade_optimizer else []
    if optimizer_allowed and trade_optimizer and not engine.optimizer:
        # the resident parameters' optimizer on the device with one layer's, along the graphs' frontier too
        trades += _sample(frontier(lc, 1))
    along = [engine, *_sample(frontier(lc))]
    # offloaded graphs beside each: two counts along the frontier, the most graphs beside the optimizer trades (each
    # replay costs a millisecond or two, inside searches that plan many points)
    offloads = [o for r in along for o in offloaded(lc, r)] + [o for r in trades for o in offloaded(lc, r, 1)]
    placements = [*along, *trades, *offloads]
    times = {r: step_of(r) for r in dict.fromkeys(placements)}
    best = min(times, key=lambda r: times[r].step_s)
    if times[best].step_s >= times[engine].step_s * (1 - PREFER_ENGINE_WITHIN):
        best = engine
    replayed = {r: (t.step_s, t.h2d_bytes, t.recomputed_layers) for r, t in times.items()}
    return Placement(best, engine, replayed), times[best]


def place(p: Point, hw: Hardware, lc: LongContext, trade_optimizer: bool = True,
          **timing: object) -> tuple[LongContext, Time, Placement | None]:
    """The batch plan with the planner's placement, its replayed step, and the search (None where the point sets
    its counts, "stream" included). `trade_optimizer`: as search's. `timing`: megatrain_time's owned_layers /
    own_reducer."""
    if p.engine.residency_set is not None:
        return lc, megatrain_time(p, hw, lc.offload, residency=lc.residency, **timing), None
    if not hw.unified_memory:  # a device that is the host's memory frees nothing by moving graphs there
        host = megatrain_memory(p, hw, lc).host_total
        lc = dataclasses.replace(lc, graph_host_room=max(0, hw.host_bytes - host))
    placement, t = search(lc, lambda r: megatrain_time(p, hw, lc.offload, residency=r, **timing),
                          not optimizer_refused(p) and "owned_layers" not in timing, trade_optimizer)
    return lc.placed(placement.chosen), t, placement
