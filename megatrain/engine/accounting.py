"""What a step cost since the last reset: time per phase, bytes over each copy stream, device peaks.

Read by collect_stats, the planner's measurements and the experiment harness; the keys are theirs.
"""

from __future__ import annotations

import torch

from .model.placement import Placement
from .parallel import node_path, shared_store
from .parallel.distributed import DataParallel
from .pipeline.schedule import LayerPipeline
from .runtime.memtrack import DeviceMemoryTracker
from .runtime.stream import Streams, Trace
from .update.optim import LayeredStep

# collect_stats()["data_path"]: the engine's DataPath (node_path.DataPath.name) in the short names the docs use
PATH_LABELS = {node_path.NODE: "node", node_path.PER_RANK: "per_rank", shared_store.SHARED: "shared_store",
               "one process": "single"}  # node_path.plan's name for a lone process


def path_label(path: node_path.DataPath | None) -> str:
    """The data path's short name: "node", "per_rank", "shared_store" or "single" (no data path: one process)."""
    return "single" if path is None else PATH_LABELS[path.name]


class StepAccounting:
    def __init__(self, device: torch.device, streams: Streams, pipeline: LayerPipeline, placement: Placement,
                 dp: DataParallel | None, layered: LayeredStep | None, memory: DeviceMemoryTracker | None,
                 trace: Trace, data_path: node_path.DataPath | None = None) -> None:
        self.device, self.streams, self.pipeline, self.placement = device, streams, pipeline, placement
        self.dp, self.layered, self.memory, self.trace = dp, layered, memory, trace
        self.data_path = data_path
        self.reset()

    @property
    def device_weight_bytes(self) -> int:
        """Weight bytes resident on the device: the layer buffers (the ring and the kept layers') plus
        embedding/norm/head."""
        g = sum(p.numel() * p.element_size() for p in self.placement.device_globals)
        return self.pipeline.device_weight_bytes + g

    def reset(self) -> None:
        self.streams.reset_counters()
        if self.dp is not None:
            self.dp.stream.reset_counters()
        if self.layered is not None:
            self.layered.reset_counters()
        self.pipeline.recomputed = self.pipeline.graph_bytes_out = 0
        self.pipeline.weight_peak_bytes = self.pipeline.device_weight_bytes
        self.act_peak = 0  # the largest forward's activations kept for backward
        if self.memory is not None:
            self.memory.reset_peak()
        self.tokens = 0
        self.seconds = {"forward_s": 0.0, "backward_s": 0.0, "optimizer_s": 0.0}
        self._wait_taken = 0.0  # the compute stream's copy waits already given by take_phases
        self.trace.clear()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def take_phases(self) -> dict[str, float]:
        """forward_s, backward_s, optimizer_s since the last take (the caller's time in each call) and copy_wait_s
        (compute's waits on copies, those the device has run since the last take: one still queued counts at a
        later take), then zeroed, without waiting for the device or the host threads: a per-step log (DeepSpeed's
        wall_clock_breakdown) that synchronized would serialize the step's overlap (~0.85 s a step at 7B)."""
        out = dict(self.seconds)
        for k in self.seconds:
            self.seconds[k] = 0.0
        waited = self.streams.wait_done_s
        out["copy_wait_s"] = max(0.0, waited - self._wait_taken)
        self._wait_taken = waited
        return out

    def host_store_bytes(self, optimizer: torch.optim.Optimizer | None) -> int:
        """The model's state in host memory, what the planner prices as the host store: the store's masters, shadows
        and gradient slabs (HostStore.host_bytes) and `optimizer`'s state held on the host (its Adam moments), each
        storage once. A frozen parameter has neither slab nor state (engine/model/trainable.py)."""
        seen: dict[int, int] = {}
        for st in (optimizer.state.values() if optimizer is not None else ()):
            for t in st.values():  # the moments (and the step counters, a few bytes each)
                if torch.is_tensor(t) and t.device.type == "cpu":
                    seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return self.placement.store.host_bytes() + sum(seen.values())

    def collect(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, float | str]:
        """The counts since the last reset (the caller waits for outstanding copies and updates first);
        `optimizer`: the one the step runs, whose host state joins host_store_bytes."""
        out = dict(self.seconds)
        if self.layered is not None:
            out["optimizer_busy_s"] = self.layered.busy_s  # on its own thread; optimizer_s is what step() took
        streams = self.streams
        out.update(
            h2d_bytes=streams.h2d.bytes, d2h_bytes=streams.d2h.bytes,
            h2d_busy_s=streams.h2d.busy_s, d2h_busy_s=streams.d2h.busy_s,
            copy_wait_s=streams.wait_s, device_weight_bytes=self.device_weight_bytes,
            peak_activation_bytes=self.act_peak, host_store_bytes=self.host_store_bytes(optimizer),
            tokens=self.tokens, data_path=path_label(self.data_path),
        )
        if self.device.type == "cuda":
            out["peak_device_bytes"] = torch.cuda.max_memory_allocated(self.device)
        else:
            # Measured live bytes when tracking (tiled working set, loss workspace included), else the count.
            # The layers' buffers at their most since the reset (a change of placement), an upper bound beside it.
            weights = self.device_weight_bytes - self.pipeline.device_weight_bytes + self.pipeline.weight_peak_bytes
            out["peak_device_bytes"] = weights + (self.memory.peak if self.memory else self.act_peak)
        out.update(self.pipeline.plan_stats())
        out.update(self.pipeline.residency_stats())
        if self.dp is not None:
            out.update(allreduce_bytes=self.dp.stream.bytes, allreduce_busy_s=self.dp.stream.busy_s)
        if streams.gather is not None:
            # The node path (docs/DISTRIBUTED.md): h2d_bytes above are this rank's shard copies; what the node's
            # all-gathers brought in from the other ranks is apart, and so is what its reduce-scatters sent out.
            out.update(gathered_bytes=streams.gather.bytes, gather_busy_s=streams.gather.busy_s,
                       scattered_bytes=streams.scatter.bytes if streams.scatter is not None else 0)
        return out
