"""The resident parameters' (embedding, final norm, LM head) upload after each step, when the device computes in a
dtype other than their FP32 masters' (CUDA, bf16).

`device_bf16.copy_(host_fp32, non_blocking=True)` converts on the host first: torch makes a full-size pageable
bf16 temporary every step, and a copy from pageable memory holds the calling thread until it is done. Here the
masters are rounded once per step into one pinned buffer of the compute dtype (round-to-nearest-even, the same
bits as `.to(dtype)`), and that buffer goes up in one asynchronous copy per tensor, 2 B/element, on a copy
stream of its own. The buffer is refilled only after the previous step's copy read it (its event, waited for on
the host: a step later, it has long finished).

The rounding (a pass over every resident parameter: ~1.5B at 14B) is a host job on a worker of its own, not the
launch thread's: `run()` records where the compute stream stands and returns; the worker rounds, then queues
the copies behind that point and records their event. `fence()`, called before the next compute that reads
the resident parameters (the embedding's forward, placement.py), waits for the worker to have queued them and
makes the compute stream wait for their event. The rounding thus runs beside the layer updates and whatever
the caller does between steps (zero_grad, the next batch) instead of after them; the next forward's embedding
still waits for it.

Not used when the resident parameters' optimizer is on the device (update/resident.py place_globals): their
compute copies are refreshed there from the device master (Placement.globals_changed's device copy).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from ..runtime.stream import CudaEvent, WatchdogError, side_threads
from ..runtime.threads import set_team
from .store import FlatGroup, HostStore


def upload_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """One host->device copy, queued on the current stream (a pinned source of the destination's dtype: a DMA)."""
    dst.copy_(src, non_blocking=True)


def round_into(staging: torch.Tensor, master: torch.Tensor) -> None:
    """FP32 -> compute dtype on the host: round-to-nearest-even, the bits `.to(dtype)` gives."""
    staging.copy_(master)


class ResidentUpload:
    """Pinned staging of the resident parameters in the compute dtype, and their upload on a copy stream."""

    def __init__(self, store: HostStore, targets: Sequence[torch.Tensor], dtype: torch.dtype,
                 device: torch.device, watchdog_s: float) -> None:
        group = store.globals
        if group.master is None or group.master.dtype == dtype:
            raise ValueError(f"a staged upload converts the FP32 masters to another dtype, got {dtype} for "
                             f"masters of {None if group.master is None else group.master.dtype}")
        self.group: FlatGroup = group
        self.targets = list(targets)
        self.device = device
        self.watchdog_s = watchdog_s
        # Pinned up front with the store (costs/pinning.py counts it: "resident upload staging").
        self.staging = store.buffer(group.numel, dtype, "resident parameters' upload staging")
        self._views = [group.view(self.staging, s) for s in group.slots]
        self._stream = torch.cuda.Stream(device=device)
        self._copied: CudaEvent | None = None  # the last upload's copies, done: the staging may be refilled
        self.nbytes = self.staging.numel() * self.staging.element_size()
        # One worker: runs are rounded and queued in order, each after the previous one's copies read the staging.
        # Its rounding (a torch copy_) runs beside the layer updates' workers: a side share of the cores, not torch's
        # whole team (which would oversubscribe them, or be one thread under a launcher's OMP_NUM_THREADS=1).
        self.threads = side_threads()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megatrain-resident-round",
                                          initializer=set_team, initargs=(self.threads,))
        self._queued: tuple[Future, object] | None = None  # the last run's job and the compute stream it fences

    def _wait_free(self) -> None:
        if self._copied is not None:
            self._copied.host_wait(self.watchdog_s)

    def _round_and_queue(self, before: torch.cuda.Event) -> torch.cuda.Event:
        """On the worker: round the masters into the staging (after its last copy finished), then queue the
        copies on the copy stream behind `before` (the compute queued before the run may still read the old
        values)."""
        self._wait_free()
        m = self.group.master.numel()
        round_into(self.staging[:m], self.group.master)
        if self.group.held_tail is not None:  # the frozen ones held as loaded in bf16 (codec.FrozenTail)
            round_into(self.staging[m:], self.group.held_tail)
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream), torch.no_grad():
            self._stream.wait_event(before)
            for dst, src in zip(self.targets, self._views):
                upload_copy(dst.detach(), src)
            done = torch.cuda.Event()
            done.record(self._stream)
        self._copied = CudaEvent(done, "resident parameters' upload")
        return done

    def run(self) -> None:
        """Queue the rounding and upload of the masters as they are now on the worker; the caller does not wait
        for it. Compute that reads the resident parameters must `fence()` first."""
        self.fence()  # the previous run's copies ordered before anything queued from here on
        compute = torch.cuda.current_stream(self.device)
        before = torch.cuda.Event()
        before.record(compute)
        self._queued = (self._worker.submit(self._round_and_queue, before), compute)

    def close(self) -> None:
        """No longer used (the resident parameters' optimizer went to the device, update/resident.py place_globals):
        its worker stopped and its pinned staging let go."""
        self.fence()
        self._worker.shutdown(wait=True)
        self.staging, self._views, self._copied = None, [], None

    def fence(self) -> None:
        """Before compute that reads the resident parameters: the last run's rounding done and its copies queued
        (a host wait on the worker), and the compute stream ordered after them (queued on the device: the host
        does not wait for the copies)."""
        if self._queued is None:
            return
        (job, compute), self._queued = self._queued, None
        try:
            done = job.result(timeout=self.watchdog_s)  # re-raises the worker's error on the launch thread
        except FutureTimeout:
            raise WatchdogError(f"the resident parameters' rounding for their upload took over {self.watchdog_s} s "
                                "(watchdog_s): the host is stalled or oversubscribed; raise watchdog_s if it is "
                                "only slow") from None
        compute.wait_event(done)
        current = torch.cuda.current_stream(self.device)
        if current != compute:
            current.wait_event(done)
