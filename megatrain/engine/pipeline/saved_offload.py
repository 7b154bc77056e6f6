"""Offloaded graphs (residency `offload`, costs/residency.py): a kept layer's forward graph whose saved activations
wait for backward in host memory.

While the layer's forward records its graph, autograd's saved-tensor hooks hand each saved tensor here: the ones
the device holds anyway (the layer's kept weights, its input, the inputs it shares with other layers) stay as
they are; the rest, the activations its forward made, are replaced in the graph by a handle. Once the forward is
done they leave on the device->host stream behind the compute that made them (the next layer's forward overlaps
the copy), and in backward they come back on the host->device stream one layer ahead, each with its own shape,
strides and dtype: the backward reads the same values in the same layout, so its gradients are the kept graph's
bit for bit. Host buffers come from a HostPool (one per saved tensor of a layer, reused from batch to batch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..runtime.memtrack import host_allocations
from ..runtime.stream import Event, Streams
from .activations import HostPool


@dataclass(frozen=True)
class Handle:
    """What the graph holds in place of an offloaded tensor: its layer, its storage's index among that layer's,
    and its view of that storage (offset in elements, shape, strides)."""

    layer: int
    group: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def end(t: torch.Tensor) -> int:
    """One past the last element of its storage that `t` reads."""
    return t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@dataclass
class _Group:
    """The saved views of one storage: the range [base, stop) of it they read goes over the link once, and each
    view is rebuilt on it (views that shared memory in the forward share it in the backward, as autograd had
    them)."""

    first: torch.Tensor
    views: list[tuple[torch.Tensor, int]]  # (view, its version when saved)


def _check(layer: int, g: _Group) -> None:
    for t, version in g.views:
        if t._version != version:  # an in-place write after it was saved: autograd would refuse it too
            raise RuntimeError(f"layer {layer}: a saved tensor {tuple(t.shape)} was modified in place after its "
                               f"forward saved it; its graph cannot be offloaded: keep it on the device (residency "
                               f"offload=0)")


class GraphOffload:
    """One forward's offloaded graphs, from the forward that records them to their layers' backward.
    `account(delta)`: the device bytes held for them change (the activation store's count)."""

    def __init__(self, streams: Streams, pool: HostPool, account: Callable[[int], None] = lambda _: None) -> None:
        self.streams = streams
        self.pool = pool
        self.account = account
        self._saved: dict[int, list[_Group]] = {}  # recorded, not yet sent
        self._host: dict[int, tuple[list[torch.Tensor], list[int], Event]] = {}  # (ranges, bases, written)
        self._device: dict[int, list[torch.Tensor]] = {}
        self._bases: dict[int, list[int]] = {}
        self._loaded: dict[int, Event] = {}
        self._recording: list[_Group] = []
        self._sending: Event | None = None  # the last copy out queued, until the next send waits for it
        self.bytes_out = 0  # bytes sent to the host by this forward's layers
        self.bytes_in = 0  # bytes brought back

    @property
    def layers(self) -> frozenset[int]:
        """The layers whose graph waits in host memory (sent, not yet backpropagated)."""
        return frozenset(self._host)

    @contextmanager
    def recording(self, layer: int, keep: Iterable[torch.Tensor]) -> Iterator[None]:
        """Record layer's forward with its saved activations set aside for `send`. `keep`: tensors the device holds
        anyway (weights, the input, shared inputs): a saved tensor on one of their storages stays in the graph."""
        kept = {_storage(t) for t in keep if isinstance(t, torch.Tensor)}
        device = self.streams.device.type
        # Reached through `self`, not a closure cell: autograd keeps each saved tensor's pack hook as long as the
        # graph, and a cell would keep every saved tensor on the device with it.
        self._recording = groups = []
        index: dict[tuple[int, torch.dtype], int] = {}

        def pack(t: torch.Tensor) -> object:
            # (a tensor off the device, e.g. a host scalar, is not the device's to free: it stays as it is)
            if t.layout != torch.strided or t.numel() == 0 or t.device.type != device or _storage(t) in kept:
                return t
            key = (_storage(t), t.dtype)
            recorded = self._recording
            if key not in index:
                index[key] = len(recorded)
                recorded.append(_Group(t.detach(), []))
            recorded[index[key]].views.append((t, t._version))
            return Handle(layer, index[key], t.storage_offset(), tuple(t.shape), t.stride())

        def unpack(packed: object) -> torch.Tensor:
            if isinstance(packed, Handle):
                flat = self._device[packed.layer][packed.group]
                base = self._bases[packed.layer][packed.group]
                return flat.as_strided(packed.shape, packed.stride, packed.offset - base)
            return packed

        del groups
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
        self._saved[layer], self._recording = self._recording, []

    def send(self, layer: int) -> None:
        """Queue the copy of layer's saved activations to the host behind the compute that made them; the device
        copies are released when it is done (the graph holds only handles)."""
        ranges, bases = self._ranges(layer, self._saved.pop(layer))
        with host_allocations():
            hosts = [self.pool.get((layer, n), r.numel(), r.dtype) for n, r in enumerate(ranges)]
        size = sum(nbytes(r) for r in ranges)
        if self.streams.device.type == "cuda":
            for t in ranges:
                t.record_stream(self.streams.d2h._stream)  # the allocator must not reuse it mid-copy
        pending = [ranges]  # dropped once copied: a finished job may sit in the copy worker until the next one
        del ranges

        def out() -> int:
            with torch.no_grad():  # the copy worker's thread has grad mode on
                for h, r in zip(hosts, pending.pop()):
                    h.copy_(r, non_blocking=True)
            return size

        written = self.streams.d2h.submit(out, self.streams.record_compute(), "graph-out", layer)
        for n in range(len(hosts)):
            self.pool.copied((layer, n), written)
        self._host[layer] = (hosts, bases, written)
        self.bytes_out += size
        # The plan holds OFFLOADED_GRAPHS_IN_FLIGHT (2) of them on the device: this one leaving, the next one
        # recorded. The previous one's copy must be done before the next forward makes more, or a link slower
        # than the compute (or a busy copy worker) would pile their device copies up behind it.
        if self._sending is not None:
            self._sending.host_wait(self.streams.watchdog_s)
        self._sending = written

    @staticmethod
    def _ranges(layer: int, groups: list[_Group]) -> tuple[list[torch.Tensor], list[int]]:
        """Each saved storage's range its views read, as one flat tensor (a view: no copy on the device), and where
        it starts. Only the returned ranges hold the device tensors afterwards (nothing of the groups is kept)."""
        ranges, bases = [], []
        for g in groups:
            _check(layer, g)
            base, stop = min(t.storage_offset() for t, _ in g.views), max(end(t) for t, _ in g.views)
            ranges.append(g.first.as_strided((stop - base,), (1,), base))
            bases.append(base)
        return ranges, bases

    def prefetch(self, layer: int) -> None:
        """Bring layer's saved activations back on the host->device stream (not waited for)."""
        if layer in self._device:
            return
        hosts, bases, written = self._host[layer]
        devs = [torch.empty(h.numel(), dtype=h.dtype, device=self.streams.device) for h in hosts]
        # As the activation store's inputs: the allocator may hand out memory queued kernels still read.
        reusable = self.streams.record_compute()
        size = sum(nbytes(h) for h in hosts)
        pending = [list(devs)]  # as in send: a finished job in the copy worker must not keep them on the device

        def back() -> int:
            with torch.no_grad():
                for d, h in zip(pending.pop(), hosts):
                    d.copy_(h, non_blocking=True)
            return size

        self._device[layer], self._bases[layer] = devs, bases
        self._loaded[layer] = self.streams.h2d.submit(back, (written, reusable), "graph-in", layer)
        for n in range(len(hosts)):
            self.pool.copied((layer, n), self._loaded[layer])
        self.bytes_in += size
        self.account(size)

    def fetch(self, layer: int) -> None:
        """Layer's saved activations on the device, waited for by the compute stream (its backward is next)."""
        self.prefetch(layer)
        self.streams.wait(self._loaded.pop(layer), f"offloaded graph of layer {layer}")

    def drop(self, layer: int) -> None:
        """Layer's backward is done: its device copies go (the host buffers stay in the pool)."""
        devs = self._device.pop(layer, [])
        self.account(-sum(nbytes(d) for d in devs))
        self._host.pop(layer, None)
        self._bases.pop(layer, None)
