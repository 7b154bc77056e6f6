"""The engine's layer pipeline replayed on a compute timeline and the copy lanes: the issue order is
costs/pipeline.py's, the one engine/pipeline/schedule.py executes, and each step here costs its seconds.
With a residency (costs/residency.py) the kept layers hold buffers of their own, loaded once per step (the
optimizer changes the masters between steps) on the h2d lane ahead of the ring's prefetches (the order issues
them first), and the graph layers' backward runs without the recompute: the
step's weight copies and recomputed layers are counted from the replay, as the engine counts its own. An
optimizer-resident layer (engine/update/resident.py) copies neither its weights up nor its gradients down. An
offloaded graph (residency `offload`, engine/pipeline/saved_offload.py) is not recomputed either: its saved
activations go out on the d2h lane after its forward and come back on the h2d lane one layer ahead of its
backward, which waits for them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..costs import pipeline as order
from ..costs import residency as kept
from ..costs.memory import layer_graph_bytes
from ..costs.pinning import STAGING_SLOTS
from .memory import layer_dims
from .point import Point

# The host workers that add gradients into their slabs (CUDA): the layers' reducer (engine/pipeline/schedule.py)
# and the resident parameters' own (engine/pipeline/global_grads.py), each a lane here.
REDUCE, REDUCE_GLOBALS = "reduce", "reduce-globals"
REDUCE_LANES = (REDUCE, REDUCE_GLOBALS)


@dataclass(frozen=True)
class LayerCosts:
    """Seconds of each job the engine queues per streamed layer, and per micro-batch around them."""

    fwd: float  # forward compute
    bwd: float  # recompute + backward compute
    load: float  # weights host -> device (h2d stream)
    act: float  # one boundary activation over the link (each way), 0 when resident
    grad: float  # gradients device -> host (d2h stream)
    reduce: float  # adding them into the host slab
    # CUDA: the add runs on a host thread after the copy, with STAGING_SLOTS (costs/pinning.py) staging slots;
    # a CPU device adds on the d2h worker, whose job lasts max(add, rate-limited copy)
    cuda: bool
    recompute: float = 0.0  # the forward recompute inside `bwd`, which a layer with a kept graph skips
    graph: float = 0.0  # one offloaded graph's saved activations over the link (each way); simulate_step fills it


class PipelineSim:
    """Replays the engine's issue order (costs/pipeline.py, which engine/pipeline/schedule.py runs; the activations'
    copies as engine/pipeline/activations.py makes them) on a compute timeline and the copy lanes, so fills,
    drains, the layers still resident at the forward/backward turn and across micro-batches, and every
    wait come out as the engine schedules them.

    Each lane runs its jobs in order; a job starts when it is issued (the compute timeline's clock)
    and its lane and inputs are free."""

    def __init__(self, n_layers: int, n_buffers: int, costs: LayerCosts,
                 residency: kept.Residency | None = None) -> None:
        self.L, self.c = n_layers, costs
        self.residency = (residency or kept.Residency()).capped(n_layers)
        self.t = self.wait = 0.0
        self.staging_wait = 0.0  # the launch thread blocked for a free gradient staging slot (the reducer's pace)
        self.lane = {"h2d": 0.0, "d2h": 0.0, REDUCE: 0.0, REDUCE_GLOBALS: 0.0}
        # job counts ("graph_out"/"graph_in": an offloaded graph's saved activations, one layer's each)
        self.bytes_jobs = {"load": 0, "act_out": 0, "act_in": 0, "grad": 0, "graph_out": 0, "graph_in": 0}
        self.recomputed = 0  # layers whose backward ran its forward again
        self.buffers = order.DeviceBuffers(n_buffers, self.residency.kept)
        self.loaded = [0.0] * len(self.buffers.resident)
        self.staging_free = [0.0] * STAGING_SLOTS
        self.next_staging = 0
        self.globals_free = 0.0  # the resident parameters' gradient staging (CUDA), free again
        self.written: dict[int, float] = {}  # offloaded activation -> when it reached the host
        self.act_ready: dict[int, float] = {}  # prefetched activation -> when it is back
        self.graph_written: dict[int, float] = {}  # offloaded graph -> when its saved activations reached the host
        self.graph_ready: dict[int, float] = {}  # prefetched offloaded graph -> when it is back
        self.spans: list[tuple[str, str, int, float, float]] = []  # (lane, kind, layer, start, end), as Trace
        self.drained_by = ""

    def _job(self, lane: str, ready: float, dur: float, kind: str, layer: int) -> float:
        start = max(ready, self.lane[lane])
        self.lane[lane] = start + dur
        self.spans.append((lane, kind, layer, start, start + dur))
        return self.lane[lane]

    def _compute(self, dur: float, kind: str, layer: int) -> None:
        self.spans.append(("compute", kind, layer, self.t, self.t + dur))
        self.t += dur

    def _wait_until(self, when: float) -> None:
        if when > self.t:
            self.wait += when - self.t
            self.t = when

    def _weights(self, step: order.Step) -> None:
        """A LOAD (a copy on the h2d lane) or a WAIT for one (the compute timeline)."""
        if step.op == order.LOAD and step.layer < self.residency.optimizer:
            self.loaded[step.slot] = self.t  # its kept weights are its device master's shadow: nothing copied
        elif step.op == order.LOAD:
            self.loaded[step.slot] = self._job("h2d", self.t, self.c.load, "load", step.layer)
            self.bytes_jobs["load"] += 1
        else:
            self._wait_until(self.loaded[step.slot])

    def _prefetch(self, layer: int) -> None:
        if self.c.act and layer not in self.act_ready:
            self.act_ready[layer] = self._job("h2d", max(self.t, self.written.pop(layer)), self.c.act, "act-in", layer)
            self.bytes_jobs["act_in"] += 1

    def _prefetch_graph(self, layer: int) -> None:
        if layer not in self.graph_ready:
            ready = max(self.t, self.graph_written.pop(layer))
            self.graph_ready[layer] = self._job("h2d", ready, self.c.graph, "graph-in", layer)
            self.bytes_jobs["graph_in"] += 1

    def _send_grad(self, layer: int) -> None:
        c = self.c
        if layer < self.residency.optimizer:
            return  # added into its device slab by the backward's own thread: no copy, no reducer job
        self.bytes_jobs["grad"] += 1
        if not c.cuda:
            self._job("d2h", self.t, max(c.grad, c.reduce), "grad", layer)
            return
        i = self.next_staging
        self.next_staging = (i + 1) % len(self.staging_free)
        self._block_for(self.staging_free[i])  # the host blocks until that staging buffer is free
        copied = self._job("d2h", self.t, c.grad, "grad", layer)
        self.staging_free[i] = self._job(REDUCE, copied, c.reduce, "reduce", layer)

    def _block_for(self, when: float) -> None:
        if when > self.t:
            self.staging_wait += when - self.t
            self.t = when

    def forward(self) -> None:
        for step in order.forward_steps(self.buffers, self.L, self.residency.graphs, self.residency.offloaded):
            i = step.layer
            if step.op in (order.LOAD, order.WAIT):
                self._weights(step)
            elif step.op == order.SEND_GRAPH:  # behind the layer's forward, under the next layer's
                self.graph_written[i] = self._job("d2h", self.t, self.c.graph, "graph-out", i)
                self.bytes_jobs["graph_out"] += 1
            elif step.op == order.SAVE_INPUT and self.c.act:
                self.written[i] = self._job("d2h", self.t, self.c.act, "act-out", i)
                self.bytes_jobs["act_out"] += 1
            elif step.op in (order.FORWARD, order.FORWARD_KEEP):  # recording the graph costs no more compute
                self._compute(self.c.fwd, "fwd", i)

    def backward(self) -> None:
        for step in order.backward_steps(self.buffers, self.L, self.residency.graphs, self.residency.offloaded):
            i = step.layer
            if step.op in (order.LOAD, order.WAIT):
                self._weights(step)
            elif step.op == order.PREFETCH_GRAPH:
                self._prefetch_graph(i)
            elif step.op == order.FETCH_GRAPH:
                self._prefetch_graph(i)
                self._wait_until(self.graph_ready.pop(i))
            elif step.op == order.PREFETCH_INPUT:
                self._prefetch(i)
            elif step.op == order.FETCH_INPUT and self.c.act:
                self._prefetch(i)
                self._wait_until(self.act_ready.pop(i))
            elif step.op == order.BACKWARD:
                self._compute(self.c.bwd, "bwd", i)
                self.recomputed += 1
            elif step.op == order.BACKWARD_KEPT:
                self._compute(self.c.bwd - self.c.recompute, "bwd", i)
            elif step.op == order.SEND_GRAD:
                self._send_grad(i)
            # DROP_INPUT frees device memory and costs no time

    def drain(self) -> str:
        """What the engine's synchronize_grads / collect_stats wait for; returns the lane that ends last."""
        last = max(self.lane, key=lambda k: self.lane[k])
        self.t = max(self.t, self.lane[last])
        return last


def graph_bytes(p: Point) -> int:
    """One layer's kept graph at this point, beyond its input and weights (costs/memory.py, as the memory plan)."""
    return layer_graph_bytes(layer_dims(p.model), p.tokens, p.c)


def graph_seconds(p: Point, costs: LayerCosts) -> float:
    """One offloaded graph's saved activations over the link, each way: at the link's rate, which a layer's weight
    copy (`costs.load`, its compute-dtype bytes) gives."""
    layer = p.model.layer_params() * p.c
    return graph_bytes(p) * costs.load / layer if layer else 0.0


def simulate_step(p: Point, costs: LayerCosts, head: float,
                  globals_grads: tuple[float, float] | None = None,
                  residency: kept.Residency | None = None) -> tuple[PipelineSim, float, float, float]:
    """One step's micro-batches through the pipeline, up to the optimizer; returns the simulation and
    the forward, backward (summed over micro-batches) and final-drain seconds. `globals_grads`: (copy, add)
    seconds of the resident parameters' gradients when they travel on the copy lane and their own reduce lane
    (CUDA: engine/pipeline/global_grads.py adds them on a worker of their own, so no layer's reduction queues
    behind the head's), queued after the head; else they are part of `head`, on the compute thread.
    `residency`: the batch's placement (the memory plan's, LongContext.residency); None: the point's own counts,
    or every layer streamed when the point says "auto" (resolving "auto" is the memory plan's job). The step
    starts with nothing resident, as after the optimizer's DeviceBuffers.invalidate()."""
    if residency is None:
        residency = p.residency if isinstance(p.residency, kept.Residency) else kept.Residency()
    if residency.offload and not costs.graph:
        costs = dataclasses.replace(costs, graph=graph_seconds(p, costs))
    sim = PipelineSim(p.model.num_layers, p.num_buffers, costs, residency)
    fwd_s = bwd_s = 0.0
    for _ in range(p.grad_accum):
        t0 = sim.t
        sim.forward()
        t1 = sim.t
        sim._compute(head, "head", -1)  # head + loss forward/backward (+ global gradients, off CUDA)
        if globals_grads is not None:
            sim._block_for(sim.globals_free)  # the host waits for the staging the last micro-batch used
            copied = sim._job("d2h", sim.t, globals_grads[0], "head-grad", -1)
            sim.globals_free = sim._job(REDUCE_GLOBALS, copied, globals_grads[1], "reduce-head-grad", -1)
        t2 = sim.t
        sim.backward()
        fwd_s += t1 - t0
        bwd_s += sim.t - t2
    t3 = sim.t
    sim.drained_by = sim.drain()  # clipping and the optimizer wait for every gradient
    return sim, fwd_s, bwd_s, sim.t - t3
