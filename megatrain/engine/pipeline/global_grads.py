"""The resident parameters' gradients (LM head, final norm, embedding rows) into their host FP32 slab, off the
compute thread.

On CUDA a blocking `.to("cpu")` of the vocab x hidden head gradient would stall the host before it queues the
last layer's backward, every micro-batch. Here the gradient leaves on the device->host copy stream into pinned
staging (allocated once) and a host worker of the sink's own adds it into the slab; the embedding's row
gradients travel the same way and are scattered on that worker. Its own, not the layers' reducer: the head's
gradient is ready first in each backward, and on a shared worker every layer's reduction queued behind its add
(at 14B: vocab x hidden, ~0.8B parameters) while the staging slots filled and backward waited. Whoever reads the
slab waits for `globals_landed` first (events.py's wait_grads does), as for the layers' gradients.

On a CPU device the "copy" is a cast in the same memory system, so the default there is to add at once on the
calling thread; `asynchronous=True` takes the threaded path on any device (the tests use it to exercise the
waits on the CPU: the copy job, a no-op there, still orders the add behind the d2h worker's jobs queued so far).

With the resident parameters' optimizer on the device (update/resident.py place_globals) their slab is there: each
gradient is added into it at once on the calling thread, queued on the compute stream behind the backward that
made it (no copy, no staging, no worker).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..host.store import HostStore
from ..runtime.stream import DONE, CopyStream, Event, Streams, side_threads
from .activations import HostPool
from .schedule import REDUCE_CHUNK, LayerPipeline, accumulate


class GlobalGradSink:
    def __init__(self, store: HostStore, streams: Streams, pipeline: LayerPipeline, dtype: torch.dtype,
                 asynchronous: bool | None = None) -> None:
        self.store = store
        self.streams = streams
        self.pipeline = pipeline
        self.cuda = streams.device.type == "cuda"
        # The resident parameters' slab on the device (update/resident.py place_globals): added there on this thread,
        # in the stream order of the backward that made them (no copy down, no worker).
        self.on_device = store.globals.grad.device.type != "cpu"
        self.asynchronous = (self.cuda if asynchronous is None else asynchronous) and not self.on_device
        self._reducer: CopyStream | None = None
        if self.asynchronous:
            # Its own worker, beside the layers' reducer (a quarter of the cores too: it runs while the first
            # layers' reductions do), so no layer's reduction queues behind the head's.
            self._reducer = type(streams.d2h)("host-reduce-globals", torch.device("cpu"), streams.trace, None,
                                               streams.watchdog_s)
            self._reducer.threads = side_threads()
            self._scratch = torch.empty(REDUCE_CHUNK, dtype=torch.float32)  # the worker's own
        # Pinned once, up front, so the store's pinned bytes match the preflight's from the start (costs/pinning.py).
        self._staging: torch.Tensor | None = (
            store.buffer(store.globals.numel, dtype, "resident gradient staging") if self.cuda and self.asynchronous
            else None)
        self._rows = HostPool(store.buffer)
        self._staging_free: Event = DONE  # the last reduction that read the dense staging
        self._rows_free: Event = DONE  # ... and the row buffers

    def _submit(self, copy, reduce, what: str) -> Event:
        """Copy to the host (CUDA: on the d2h stream, after the compute queued so far; a CPU device: a no-op job
        there), then reduce on the sink's own worker; the reduction's event is what the pipeline waits for before
        any reader of the slab."""
        copied = self.streams.d2h.submit(copy, self.streams.record_compute(), what, -1)
        done = self._reducer.submit(reduce, copied, "reduce-" + what, -1)
        self.pipeline.events.globals_landed.append(done)
        return done

    def add_dense(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Add one gradient per global slot (in slot order; None: no gradient) into the slab."""
        group = self.store.globals
        pairs = [(s, g) for s, g in zip(group.slots, grads) if g is not None]
        if not pairs:
            return
        if not self.asynchronous:
            for s, g in pairs:
                slab = group.view(group.grad, s)
                # widened inside the add (exact: the same bits as adding its FP32 copy), without a vocab x hidden
                # FP32 temporary on the device
                slab.add_(g.to(slab.device))
            return
        if self.cuda:
            self._staging_free.host_wait(self.streams.watchdog_s)  # the previous micro-batch's add read it
            staging = self._staging
            for _, g in pairs:
                g.record_stream(self.streams.d2h._stream)  # the allocator must not reuse it mid-copy
        else:
            staging = None
        nbytes = sum(g.numel() * g.element_size() for _, g in pairs)

        def copy() -> int:
            if staging is None:
                return 0
            for s, g in pairs:
                group.view(staging, s).copy_(g, non_blocking=True)
            return nbytes

        def reduce() -> int:
            for s, g in pairs:  # on the sink's worker: its scratch is free to use
                accumulate(group.view(group.grad, s), group.view(staging, s) if staging is not None else g,
                           self._scratch)
            return 0

        self._staging_free = self._submit(copy, reduce, "head-grad")

    def add_rows(self, slot_index: int, rows: torch.Tensor, grad: torch.Tensor) -> None:
        """Scatter-add `grad` [n, hidden] into rows `rows` [n] of global slot `slot_index` (the embedding)."""
        group = self.store.globals
        slab = group.view(group.grad, group.slots[slot_index])
        rows, grad = rows.reshape(-1), grad.reshape(-1, grad.shape[-1])
        if not self.asynchronous:
            slab.index_add_(0, rows.to(slab.device), grad.to(slab.device, torch.float32))
            return
        if self.cuda:
            self._rows_free.host_wait(self.streams.watchdog_s)
            host_rows = self._rows.get(0, rows.numel(), torch.long)
            host_grad = self._rows.get(1, grad.numel(), grad.dtype).view(grad.shape)
            for t in (rows, grad):
                if t.is_cuda:  # the rows may be host ids already (embedding.lookup_grad)
                    t.record_stream(self.streams.d2h._stream)
        else:
            host_rows, host_grad = rows, grad

        def copy() -> int:
            if not self.cuda:
                return 0
            host_rows.copy_(rows, non_blocking=True)
            host_grad.copy_(grad, non_blocking=True)
            return rows.numel() * 8 + grad.numel() * grad.element_size()

        def reduce() -> int:
            slab.index_add_(0, host_rows, host_grad.float() if host_grad.dtype != slab.dtype else host_grad)
            return 0

        self._rows_free = self._submit(copy, reduce, "embed-grad")
