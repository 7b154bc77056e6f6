"""Measured device memory on a CPU "device": the live bytes of every tensor storage the step allocates.

On CUDA `torch.cuda.max_memory_allocated` is the truth. On the CPU there is no allocator to ask (RSS
mixes in the host store, the allocator's caching and other threads), so the engine can track, op by
op, each new storage created on the compute thread and release it when the storage is freed. That is
what the same computation would hold on a device, and it exposes anything O(tokens²) (a materialized
attention mask or score matrix) that an analytic count would miss.

State that lives on the device across steps but is not made inside a tracked step is held (`hold`): the
optimizer-resident layers' and the resident parameters' FP32 master, gradient slab and Adam state (update/resident.py),
which the device plan counts (costs/residency.py OPTIMIZER_BYTES_PER_PARAM). On a CPU device those are the host
store's own buffers (an FP32 master is not copied), so without `hold` the measured peak left them out.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_host = threading.local()


@contextmanager
def untracked() -> Iterator[None]:
    """Allocations inside this block are not the tracked working set: host memory (e.g. offload staging), or
    device memory counted on its own (the layer weight buffers, in device_weight_bytes)."""
    prev = getattr(_host, "on", False)
    _host.on = True
    try:
        yield
    finally:
        _host.on = prev


host_allocations = untracked  # the name its host-side callers read


class _Mode(TorchDispatchMode):
    def __init__(self, tracker: DeviceMemoryTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not getattr(_host, "on", False):
            self.tracker._note(out, (args, kwargs))
        return out


class DeviceMemoryTracker:
    """Live and peak bytes of storages created on `device` while the tracker is entered.

    A storage counts from the op that created it until it is freed, even if that happens after the
    tracker is exited (boundary activations kept from forward to backward stay counted).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.tracked_live = 0
        self.tracked_peak = 0
        self._owned: dict[int, weakref.finalize] = {}
        self._lock = threading.RLock()  # a finalizer may fire while _note holds it
        self._held: list[Callable[[], Iterable[torch.Tensor]]] = []

    def hold(self, source: Callable[[], Iterable[torch.Tensor]]) -> None:
        """Count the tensors `source()` gives (read at each look: Adam's state appears at the first step) as live
        device memory for as long as they exist, once per storage, beside what the step allocates."""
        self._held.append(source)

    @property
    def held_bytes(self) -> int:
        seen: set[int] = set()
        total = 0
        with self._lock:
            owned = set(self._owned)
        for source in self._held:
            for t in source():
                if not isinstance(t, torch.Tensor) or t.device.type != self.device.type or t.is_meta:
                    continue
                st = t.untyped_storage()
                ptr = st.data_ptr()
                if ptr in seen or ptr in owned or st.nbytes() == 0:  # a step's own allocation counts as tracked
                    continue
                seen.add(ptr)
                total += st.nbytes()
        return total

    @property
    def live(self) -> int:
        return self.tracked_live + self.held_bytes

    @property
    def peak(self) -> int:
        """The step's peak: the most its own storages reached, with the held state beside them the whole time."""
        return self.tracked_peak + self.held_bytes

    @peak.setter
    def peak(self, value: int) -> None:
        """Set the peak as read (held state included): what a caller restores after measuring a phase alone."""
        self.tracked_peak = value - self.held_bytes

    def reset_peak(self) -> None:
        self.tracked_peak = self.tracked_live

    def _release(self, ptr: int, nbytes: int) -> None:
        with self._lock:
            if self._owned.pop(ptr, None) is not None:
                self.tracked_live -= nbytes

    def _note(self, out: Any, inputs: Any) -> None:
        fresh = []
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == self.device.type and not t.is_meta:
                fresh.append(t)
        if not fresh:
            return
        # An output that shares an input's storage (a view, an in-place op, a no-op .to) allocated nothing.
        reused = {t.untyped_storage().data_ptr() for t in tree_flatten(inputs)[0]
                  if isinstance(t, torch.Tensor) and t.device.type == self.device.type and not t.is_meta}
        with self._lock:
            for t in fresh:
                st = t.untyped_storage()
                ptr, n = st.data_ptr(), st.nbytes()
                if n == 0 or ptr in reused or ptr in self._owned:
                    continue
                self._owned[ptr] = weakref.finalize(st, self._release, ptr, n)
                self.tracked_live += n
                self.tracked_peak = max(self.tracked_peak, self.tracked_live)

    @contextmanager
    def track(self) -> Iterator[None]:
        with _Mode(self):
            yield


def resident_state(store: Any, layers: Iterable[int], globals_resident: bool, optimizer: Any) -> list[torch.Tensor]:
    """The device-resident optimizer state (update/resident.py) of `store`: the optimizer-resident `layers'` and,
    where `globals_resident`, the resident parameters' FP32 master, gradient slabs and `optimizer`'s per-parameter
    state (Adam's m and v, once made). The kept compute weights are counted apart (device_weight_bytes)."""
    groups = [store.layers[i] for i in layers] + ([store.globals] if globals_resident else [])
    out: list[torch.Tensor] = []
    for g in groups:
        out += [t for t in (g.master, g.grad, getattr(g, "grad_work", None)) if t is not None]
        for p in g.params:
            out += [v for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return out


def tracked(method: Callable) -> Callable:
    """`method` run under its object's tracker, `self.memory` (a DeviceMemoryTracker; None: untracked).

    A decorator on the class, so the method the class defines is the one that runs: nothing is rebound on
    an instance, and a tracker set or cleared later takes effect at the next call.
    """

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        memory = self.memory
        with memory.track() if memory is not None else nullcontext():
            return method(self, *args, **kwargs)

    return run
