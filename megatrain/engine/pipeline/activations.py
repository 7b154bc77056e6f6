"""Layer-boundary activations kept from forward to backward: on the device, or offloaded to host memory.

Offloaded activations leave on the device->host stream as each layer finishes and come back on the
host->device stream one layer ahead of the backward pass, so device memory for them stays O(1) in depth.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...costs.memory import OFFLOAD_IN_FLIGHT, OFFLOAD_IN_FLIGHT_TIGHT
from ..host.store import host_empty
from ..runtime.memtrack import host_allocations
from ..runtime.stream import Event, Streams

GROWTH = 1.5  # HostPool: a buffer that must grow takes this much more than it held (at most 1.5x the need)


class HostPool:
    """Host buffers for offloaded activations, one per layer, reused from batch to batch (grown when a batch
    is larger): pinning is slow (every page is faulted in and locked), so it happens once, not per layer
    per step. Reuse is safe: a layer's buffer is written on the device->host stream only after the
    compute stream passed that layer's previous backward, which waited for the buffer's read. Freeing is not, by
    itself: that wait is queued on the device, and a buffer freed (unpinned) when it grows may still be read or
    written by a queued copy, so the pool waits on the host for the buffer's last copy (`copied`) first."""

    def __init__(self, alloc: Callable[[int, torch.dtype, str], torch.Tensor], watchdog_s: float = 600.0) -> None:
        self.alloc = alloc
        self.watchdog_s = watchdog_s
        self._buffers: dict[int, torch.Tensor] = {}
        self._last: dict[int, Event] = {}  # each buffer's last copy queued

    def copied(self, layer: int, event: Event) -> None:
        """`event`: a copy into or out of layer's buffer queued after every earlier one (done when they are)."""
        self._last[layer] = event

    def get(self, layer: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self._buffers.get(layer)
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            # Grown geometrically (1.5x what it held), not to the exact size: batches that lengthen a little at
            # a time would otherwise pin (fault in and lock) every layer's buffer again inside the layer loop.
            grow = int(buf.numel() * GROWTH) if buf is not None and buf.dtype == dtype else 0
            last = self._last.pop(layer, None)
            if buf is not None and last is not None and not last.done():
                last.host_wait(self.watchdog_s)  # a queued copy still reads or writes it: not freed under it
            self._buffers.pop(layer, None)  # freed (and unregistered) before its larger replacement is pinned
            buf = self._buffers[layer] = self.alloc(max(numel, grow), dtype, "offloaded activations")
        return buf[:numel]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


class ActivationStore:
    """`in_flight`: the boundary activations the device holds at once when offloaded (costs/memory.py): with
    OFFLOAD_IN_FLIGHT copies overlap compute (one leaving while the next layer runs, one prefetched in
    backward); with OFFLOAD_IN_FLIGHT_TIGHT (the budget binds) each put waits for its copy out and an input
    comes back only when its layer asks for it."""

    def __init__(self, streams: Streams, offload: bool, pin: bool | HostPool, in_flight: int = OFFLOAD_IN_FLIGHT) -> None:
        self.streams = streams
        self.offload = offload
        self.serial = offload and in_flight <= OFFLOAD_IN_FLIGHT_TIGHT
        self.pin = pin
        self._device: dict[int, torch.Tensor] = {}
        self._host: dict[int, tuple[torch.Tensor, Event]] = {}
        self._loaded: dict[int, Event] = {}
        self.graphs: dict[int, tuple] = {}  # residency: layers whose forward graph is kept (schedule.py)
        self.saved = None  # this forward's offloaded graphs (saved_offload.GraphOffload), where it has some
        self.device_bytes = 0
        self.peak_device_bytes = 0

    @staticmethod
    def _nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def _account(self, delta: int) -> None:
        self.device_bytes += delta
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)

    def put(self, layer: int, h: torch.Tensor) -> None:
        if not self.offload:
            self._device[layer] = h
            self._account(self._nbytes(h))
            return
        with host_allocations():
            if isinstance(self.pin, HostPool):
                host = self.pin.get(layer, h.numel(), h.dtype).view(h.shape)
            else:
                host = host_empty(h.numel(), h.dtype, self.pin, "offloaded activations").view(h.shape)
        if h.device.type == "cuda":
            h.record_stream(self.streams.d2h._stream)

        pending = [h]  # dropped once copied: a finished job may sit in the copy worker until the next one

        def out() -> int:
            src = pending.pop()
            host.copy_(src, non_blocking=True)
            return self._nbytes(src)

        self._host[layer] = (host, self.streams.d2h.submit(out, self.streams.record_compute(), "act-out", layer))
        if isinstance(self.pin, HostPool):
            self.pin.copied(layer, self._host[layer][1])
        if self.serial:
            self.streams.wait(self._host[layer][1], f"activation of layer {layer} to the host")

    def prefetch(self, layer: int) -> None:
        if not self.serial:
            self._fetch(layer)

    def _fetch(self, layer: int) -> None:
        if not self.offload or layer in self._device:
            return
        host, written = self._host[layer]
        dev = torch.empty(host.shape, dtype=host.dtype, device=self.streams.device)
        # The caching allocator may hand out memory that kernels already queued on the compute stream
        # still read (it orders reuse on the allocating stream only), and the copy writes it from
        # another stream: it must wait for that queued work too.
        reusable = self.streams.record_compute()

        def back() -> int:
            dev.copy_(host, non_blocking=True)
            return self._nbytes(host)

        self._device[layer] = dev
        self._loaded[layer] = self.streams.h2d.submit(back, (written, reusable), "act-in", layer)
        if isinstance(self.pin, HostPool):
            self.pin.copied(layer, self._loaded[layer])  # behind the copy out (it waits for `written`)
        self._account(self._nbytes(dev))

    def get(self, layer: int) -> torch.Tensor:
        if self.offload:
            self._fetch(layer)
            self.streams.wait(self._loaded.pop(layer), f"activation of layer {layer}")
        return self._device[layer]

    def keep_graph(self, layer: int, graph: tuple) -> None:
        """A kept layer's forward graph (input leaf, weight leaves, output, router logits) until its backward. Its
        input is counted as a boundary activation kept on the device (the saved tensors are the graph's own)."""
        self.graphs[layer] = graph
        self._account(self._nbytes(graph[0]))

    def take_graph(self, layer: int) -> tuple:
        graph = self.graphs.pop(layer)
        self._account(-self._nbytes(graph[0]))
        return graph

    def drop(self, layer: int) -> None:
        t = self._device.pop(layer, None)
        if t is not None:
            self._account(-self._nbytes(t))
        self._host.pop(layer, None)
