"""Compute and copy streams with events — CUDA streams on a GPU, worker threads on the CPU.

On the CPU the copy streams are real threads (torch releases the GIL inside copies), so a prefetch
truly overlaps compute and a missing wait shows up as a wrong result, exactly as it would on a GPU.
An optional rate limit makes the CPU copy engine behave like a PCIe or NVLink-C2C link.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


class WatchdogError(RuntimeError):
    """A stream made no progress for longer than the configured watchdog time."""


@dataclass
class TraceRecord:
    stream: str  # "compute" | "h2d" | "d2h"
    kind: str  # e.g. "fwd", "bwd", "load", "grad"
    layer: int
    t_start: float  # seconds since the engine's clock origin
    t_end: float


class Trace:
    """Per-layer timeline of the three streams, for overlap checks and timeline plots."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.origin = time.perf_counter()
        self.records: list[TraceRecord] = []
        self._lock = threading.Lock()

    def now(self) -> float:
        return time.perf_counter() - self.origin

    def add(self, stream: str, kind: str, layer: int, t0: float, t1: float) -> None:
        if self.enabled:
            with self._lock:
                self.records.append(TraceRecord(stream, kind, layer, t0, t1))

    def clear(self) -> None:
        with self._lock:
            self.records.clear()


class Event:
    """Completion of one queued operation.

    `wait` orders the compute stream after it (a device-side wait on CUDA); `host_wait` blocks the
    calling host thread. On the CPU the two are the same.
    """

    def wait(self, timeout: float) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def host_wait(self, timeout: float) -> None:
        self.wait(timeout)

    def done(self) -> bool:  # pragma: no cover - interface
        raise NotImplementedError


class _DoneEvent(Event):
    def wait(self, timeout: float) -> None:
        return None

    def done(self) -> bool:
        return True


DONE = _DoneEvent()


class _ThreadEvent(Event):
    def __init__(self, what: str) -> None:
        self.what = what
        self._flag = threading.Event()
        self.error: BaseException | None = None

    def set(self, error: BaseException | None = None) -> None:
        self.error = error
        self._flag.set()

    def wait(self, timeout: float) -> None:
        if not self._flag.wait(timeout):
            raise WatchdogError(f"no progress for {timeout:.1f}s waiting on {self.what}")
        if self.error is not None:
            raise RuntimeError(f"{self.what} failed: {self.error}") from self.error

    def done(self) -> bool:
        return self._flag.is_set()


class _CudaEvent(Event):
    def __init__(self, event: torch.cuda.Event, what: str) -> None:
        self.event = event
        self.what = what

    def wait(self, timeout: float) -> None:
        # Ordering on the device, not a host sync: the compute stream waits for the copy.
        torch.cuda.current_stream().wait_event(self.event)

    def host_wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.event.query():
            if time.monotonic() > deadline:
                raise WatchdogError(f"no progress for {timeout:.1f}s waiting on {self.what}")
            time.sleep(1e-4)

    def done(self) -> bool:
        return self.event.query()


class CopyStream:
    """One direction of the host<->device link: jobs run in order, each after an optional event."""

    def __init__(self, name: str, device: torch.device, trace: Trace, gbps: float | None = None,
                 watchdog_s: float = 600.0) -> None:
        self.name = name
        self.device = device
        self.trace = trace
        self.gbps = gbps
        self.watchdog_s = watchdog_s
        self.bytes = 0  # bytes moved since the last reset
        self.busy_s = 0.0  # time the link was busy (CPU) since the last reset
        self.stall_s = 0.0  # test hook: extra seconds each job sleeps (an injected stall)
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._stream = torch.cuda.Stream(device=device)
            self._last: Event = DONE
        else:
            self._queue: queue.Queue = queue.Queue()
            self._last = DONE
            self._worker = threading.Thread(target=self._run, name=f"megatrain-{name}", daemon=True)
            self._worker.start()

    def submit(self, fn: Callable[[], int], after: Event, kind: str, layer: int) -> Event:
        """Queue `fn` (which moves bytes and returns how many) to start once `after` is done."""
        what = f"{self.name} stream ({kind}, layer {layer})"
        if self._cuda:
            with torch.cuda.stream(self._stream):
                if isinstance(after, _CudaEvent):
                    self._stream.wait_event(after.event)
                ev = torch.cuda.Event(enable_timing=self.trace.enabled)
                nbytes = fn()
                ev.record(self._stream)
            self.bytes += nbytes
            self._last = _CudaEvent(ev, what)
            return self._last
        done = _ThreadEvent(what)
        self._queue.put((fn, after, done, kind, layer))
        self._last = done
        return done

    def _run(self) -> None:
        while True:
            fn, after, done, kind, layer = self._queue.get()
            try:
                after.host_wait(self.watchdog_s)
                t0 = self.trace.now()
                if self.stall_s:
                    time.sleep(self.stall_s)
                nbytes = fn()
                if self.gbps:
                    # Emulate a link of `gbps`: a transfer cannot finish before bytes / rate.
                    remaining = nbytes / (self.gbps * 1e9) - (self.trace.now() - t0)
                    if remaining > 0:
                        time.sleep(remaining)
                t1 = self.trace.now()
                self.bytes += nbytes
                self.busy_s += t1 - t0
                self.trace.add(self.name, kind, layer, t0, t1)
                done.set()
            except BaseException as exc:  # surfaced to whoever waits on this job
                done.set(exc)

    def synchronize(self) -> None:
        """Block the host until every queued job has finished."""
        last = self._last
        last.host_wait(self.watchdog_s)

    def reset_counters(self) -> None:
        self.synchronize()
        self.bytes = 0
        self.busy_s = 0.0


class Streams:
    """The compute stream plus the two copy streams of one device."""

    def __init__(self, device: torch.device, trace: Trace, link_gbps: float | None, watchdog_s: float) -> None:
        self.device = device
        self.trace = trace
        self.watchdog_s = watchdog_s
        self.h2d = CopyStream("h2d", device, trace, link_gbps, watchdog_s)
        self.d2h = CopyStream("d2h", device, trace, link_gbps, watchdog_s)
        self.wait_s = 0.0  # time compute spent blocked on copies since the last reset

    def record_compute(self) -> Event:
        """An event that completes when the work queued on the compute stream so far is done."""
        if self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            return _CudaEvent(ev, "compute stream")
        return DONE  # CPU compute is synchronous on the calling thread

    def wait(self, event: Event, what: str) -> None:
        t0 = time.perf_counter()
        try:
            event.wait(self.watchdog_s)
        except WatchdogError as exc:
            raise WatchdogError(f"{exc} (compute stream blocked in {what})") from None
        self.wait_s += time.perf_counter() - t0

    def synchronize(self) -> None:
        self.h2d.synchronize()
        self.d2h.synchronize()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def reset_counters(self) -> None:
        self.h2d.reset_counters()
        self.d2h.reset_counters()
        self.wait_s = 0.0
