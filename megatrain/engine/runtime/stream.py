"""Compute and copy streams with events — CUDA streams on a GPU, worker threads on the CPU.

On the CPU the copy streams are real threads (torch releases the GIL inside copies), so a prefetch
truly overlaps compute and a missing wait shows up as a wrong result, exactly as it would on a GPU.
An optional rate limit makes the CPU copy engine behave like a PCIe or NVLink-C2C link.
"""

from __future__ import annotations

import atexit
import queue
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .threads import host_cores, set_team


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
    """Per-layer timeline of the three streams, for overlap checks and timeline plots.

    On a GPU the host only queues work, so its clock says nothing about when a layer or a copy ran:
    device work is timed with CUDA events and placed on the host clock when the records are read.
    """

    def __init__(self, enabled: bool, device: torch.device | None = None) -> None:
        self.enabled = enabled
        self._cuda = device is not None and device.type == "cuda"
        self.device = device  # the engine's: events and syncs act there, not on whichever device is current
        self.origin = time.perf_counter()
        self._records: list[TraceRecord] = []
        self._spans: list[tuple[str, str, int, torch.cuda.Event, torch.cuda.Event]] = []
        self._ref: tuple[torch.cuda.Event, float] | None = None
        self._lock = threading.Lock()
        self.clear()

    def now(self) -> float:
        return time.perf_counter() - self.origin

    def add(self, stream: str, kind: str, layer: int, t0: float, t1: float) -> None:
        if self.enabled:
            with self._lock:
                self._records.append(TraceRecord(stream, kind, layer, t0, t1))

    def add_span(self, stream: str, kind: str, layer: int, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        if self.enabled:
            with self._lock:
                self._spans.append((stream, kind, layer, start, end))

    def mark(self) -> float | torch.cuda.Event | None:
        """Start of a span of work on the current stream, for `add_since`."""
        if not self.enabled:
            return None
        if not self._cuda:
            return self.now()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def add_since(self, stream: str, kind: str, layer: int, start: float | torch.cuda.Event | None) -> None:
        if start is None:
            return
        if isinstance(start, float):
            self.add(stream, kind, layer, start, self.now())
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record(torch.cuda.current_stream(self.device))
        self.add_span(stream, kind, layer, start, end)

    @property
    def records(self) -> list[TraceRecord]:
        """Every record so far; reading waits for the device work still being timed."""
        with self._lock:
            spans, self._spans = self._spans, []
        if spans and self._ref is not None:
            ref, ref_t = self._ref
            resolved = []
            for stream, kind, layer, start, end in spans:
                end.synchronize()
                resolved.append(TraceRecord(stream, kind, layer, ref_t + ref.elapsed_time(start) / 1e3,
                                            ref_t + ref.elapsed_time(end) / 1e3))
            with self._lock:
                self._records.extend(resolved)
                self._records.sort(key=lambda r: r.t_start)
        return self._records

    def clear(self) -> None:
        with self._lock:
            self._records.clear()
            self._spans.clear()
        if self._cuda and self.enabled:
            # The reference event that maps device time onto the host clock is taken on an idle device,
            # so it runs the moment it is queued.
            torch.cuda.synchronize(self.device)
            ref = torch.cuda.Event(enable_timing=True)
            ref.record(torch.cuda.current_stream(self.device))
            self._ref = (ref, self.now())


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


class CudaEvent(Event):
    """A recorded CUDA event: waited for on the device by the compute stream, or polled from the host."""

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


class _DeferredCudaEvent(CudaEvent):
    """A CUDA job whose submission waits for host work (a layer's update on the optimizer thread): the copy
    stream's helper thread queues it once that is done, so the launch thread does not block at submit and
    keeps queueing device work. Whoever needs the device event itself waits only until it is recorded."""

    def __init__(self, what: str, timeout: float) -> None:
        self.what = what
        self._timeout = timeout
        self._resolved = threading.Event()
        self._event: torch.cuda.Event | None = None
        self.error: BaseException | None = None

    def resolve(self, event: CudaEvent | None, error: BaseException | None = None) -> None:
        self._event, self.error = (event.event if event is not None else None), error
        self._resolved.set()

    @property
    def resolved(self) -> bool:
        return self._resolved.is_set()

    @property
    def event(self) -> torch.cuda.Event:  # type: ignore[override]
        if not self._resolved.wait(self._timeout):
            raise WatchdogError(f"no progress for {self._timeout:.1f}s waiting on {self.what} (queued behind host work)")
        if self.error is not None:
            raise RuntimeError(f"{self.what} failed: {self.error}") from self.error
        return self._event

    def done(self) -> bool:
        return self.resolved and self.error is None and self._event.query()


class _CudaSpans:
    """Start/end event pairs of device work, summed lazily.

    An elapsed time can be read only once both events have completed, and the per-layer loop must
    never wait for that: pairs are kept and folded in when done, or when the caller reads the total
    (after synchronizing).
    """

    def __init__(self) -> None:
        self._pending: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        self._done_s = 0.0

    def add(self, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        self._pending.append((start, end))
        if len(self._pending) > 64:  # bound the events held when nobody reads the total
            self._fold(block=False)

    def _fold(self, block: bool) -> None:
        while self._pending:
            start, end = self._pending[0]
            if block:
                end.synchronize()
            elif not end.query():
                return
            self._done_s += start.elapsed_time(end) / 1e3
            self._pending.popleft()

    def total_s(self) -> float:
        self._fold(block=True)
        return self._done_s

    def done_s(self) -> float:
        """The spans that have finished so far, summed without waiting for the rest (they count at a later read)."""
        self._fold(block=False)
        return self._done_s

    def reset(self) -> None:
        self._pending.clear()
        self._done_s = 0.0


def _drain_at_exit(ref: weakref.ref) -> None:
    """Let a stream's queued jobs (gradient adds, layer updates, averages) finish before the interpreter exits: a
    daemon thread still inside a torch op while the process tears down aborts it ("terminate called ...")."""
    stream = ref()
    if stream is None:
        return
    try:
        stream.synchronize()
    except Exception as exc:  # nobody is left to wait on the job that failed: say so, at least
        print(f"megatrain: a queued {stream.name} job failed at exit: {exc}", file=sys.stderr)


def side_threads(cores: int | None = None) -> int:
    """Torch threads for a host thread whose work runs beside the main work of the moment (the gradient
    reducer beside backward, itself launching or computing with every core): a quarter of the cores, at least
    one. Elementwise adds are memory-bound: a few threads reach the bandwidth one socket gives. Of `cores`
    (default: this process's share of the host, threads.host_cores)."""
    n = cores if cores is not None else host_cores()
    return max(1, n // 4)


class CopyStream:
    """One direction of the host<->device link: jobs run in order, each after optional events."""

    def __init__(self, name: str, device: torch.device, trace: Trace, gbps: float | None = None,
                 watchdog_s: float = 600.0) -> None:
        self.name = name
        self.device = device
        self.trace = trace
        self.gbps = gbps
        self.watchdog_s = watchdog_s
        self.bytes = 0  # bytes moved since the last reset
        self._busy_s = 0.0
        self.stall_s = 0.0  # test hook: extra seconds each job sleeps (an injected stall)
        # Torch (OpenMP) threads this stream's host worker runs its jobs with; None: torch's default, every core.
        # A thread that does host work while others do too takes a share, so they do not oversubscribe the cores.
        self.threads: int | None = None
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._stream = torch.cuda.Stream(device=device)
            self._spans = _CudaSpans()
            self._last: Event = DONE
            self._lock = threading.Lock()  # the launch thread and the helper both queue on the device stream
            self._deferred: queue.Queue = queue.Queue()
            self._helper = threading.Thread(target=self._run_deferred, name=f"megatrain-{name}-defer", daemon=True)
            self._helper.start()
        else:
            self._queue: queue.Queue = queue.Queue()
            self._last = DONE
            self._worker = threading.Thread(target=self._run, name=f"megatrain-{name}", daemon=True)
            self._worker.start()
            atexit.register(_drain_at_exit, weakref.ref(self))

    @property
    def busy_s(self) -> float:
        """Time the link was busy since the last reset (on a GPU: device time of the copies)."""
        return self._busy_s + (self._spans.total_s() if self._cuda else 0.0)

    @busy_s.setter
    def busy_s(self, value: float) -> None:
        self._busy_s = value

    def submit(self, fn: Callable[[], int], after: Event | Sequence[Event], kind: str, layer: int) -> Event:
        """Queue `fn` (which moves bytes and returns how many) to start once every `after` is done."""
        what = f"{self.name} stream ({kind}, layer {layer})"
        afters = (after,) if isinstance(after, Event) else tuple(after)
        if self._cuda:
            with self._lock:
                # Behind unfinished host work (or a job already waiting for some: the stream's order holds), the
                # helper thread queues it when that is done; the caller goes on queueing device work.
                waiting = [ev for ev in afters if not ev.done() and
                           (not isinstance(ev, CudaEvent) or isinstance(ev, _DeferredCudaEvent) and not ev.resolved)]
                if waiting or (isinstance(self._last, _DeferredCudaEvent) and not self._last.resolved):
                    deferred = _DeferredCudaEvent(what, self.watchdog_s)
                    self._deferred.put((fn, afters, deferred, kind, layer, what))
                    self._last = deferred
                    return deferred
                self._last = self._enqueue(fn, afters, kind, layer, what)
                return self._last
        done = _ThreadEvent(what)
        self._queue.put((fn, afters, done, kind, layer))
        self._last = done
        return done

    def _enqueue(self, fn: Callable[[], int], afters: Sequence[Event], kind: str, layer: int,
                 what: str) -> CudaEvent:
        """Queue `fn` on the device stream behind `afters` (their host parts done, or waited for here)."""
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            for ev in afters:
                if isinstance(ev, CudaEvent):
                    self._stream.wait_event(ev.event)
                else:
                    ev.host_wait(self.watchdog_s)
            start = torch.cuda.Event(enable_timing=True)
            start.record(self._stream)
            nbytes = fn()
            end = torch.cuda.Event(enable_timing=True)
            end.record(self._stream)
        self.bytes += nbytes
        self._spans.add(start, end)
        self.trace.add_span(self.name, kind, layer, start, end)
        return CudaEvent(end, what)

    def _run_deferred(self) -> None:
        while True:
            fn, afters, deferred, kind, layer, what = self._deferred.get()
            try:
                for ev in afters:
                    if not isinstance(ev, CudaEvent):
                        ev.host_wait(self.watchdog_s)
                    elif isinstance(ev, _DeferredCudaEvent):
                        ev.event  # noqa: B018 - recorded before this stream's lock is taken (no lock-order cycle)
                with self._lock:
                    deferred.resolve(self._enqueue(fn, afters, kind, layer, what))
            except BaseException as exc:  # surfaced to whoever waits on this job
                deferred.resolve(None, exc)

    def _run(self) -> None:
        applied = None
        while True:
            fn, afters, done, kind, layer = self._queue.get()
            if self.threads != applied and self.threads is not None:
                applied = self.threads
                set_team(applied)  # this thread's own OpenMP team (not the process-wide default)
            try:
                for after in afters:
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
        if self._cuda:
            self._spans.reset()


class Streams:
    """The compute stream plus the two copy streams of one device, and on the node path (docs/DISTRIBUTED.md)
    two more: `gather`, the weights' all-gathers, apart from the shard copies on `h2d` so a gather never queues
    behind the next layer's copy, and `scatter`, the gradients' reduce-scatters, apart from the shard copies on
    `d2h` (each on a GPU a CUDA stream the collectives are issued on, on the CPU a thread of its own)."""

    def __init__(self, device: torch.device, trace: Trace, link_gbps: float | None, watchdog_s: float) -> None:
        self.device = device
        self.trace = trace
        self.watchdog_s = watchdog_s
        self.h2d = CopyStream("h2d", device, trace, link_gbps, watchdog_s)
        self.d2h = CopyStream("d2h", device, trace, link_gbps, watchdog_s)
        self.gather: CopyStream | None = None  # the node path's (add_gather); None: one process, the per-rank path
        self.scatter: CopyStream | None = None  # the node path's gradients (add_scatter); None likewise
        self._wait_s = 0.0
        self._cuda_waits = _CudaSpans() if device.type == "cuda" else None

    def add_gather(self) -> CopyStream:
        """The gather stream, made on first use (a process on the per-rank path never starts its thread). Not rate
        limited: what it moves crosses NVLink, not the emulated host link."""
        if self.gather is None:
            self.gather = CopyStream("gather", self.device, self.trace, None, self.watchdog_s)
        return self.gather

    def add_scatter(self) -> CopyStream:
        """The scatter stream, made on first use (as add_gather)."""
        if self.scatter is None:
            self.scatter = CopyStream("scatter", self.device, self.trace, None, self.watchdog_s)
        return self.scatter

    def copy_streams(self) -> list[CopyStream]:
        return [s for s in (self.h2d, self.d2h, self.gather, self.scatter) if s is not None]

    @property
    def wait_s(self) -> float:
        """Time compute spent blocked on copies since the last reset (on a GPU: device time)."""
        return self._wait_s + (self._cuda_waits.total_s() if self._cuda_waits is not None else 0.0)

    @wait_s.setter
    def wait_s(self, value: float) -> None:
        self._wait_s = value

    @property
    def wait_done_s(self) -> float:
        """wait_s without waiting for the device: the waits queued on a GPU count once they have run."""
        return self._wait_s + (self._cuda_waits.done_s() if self._cuda_waits is not None else 0.0)

    def record_compute(self) -> Event:
        """An event that completes when the work queued on the compute stream so far is done."""
        if self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            return CudaEvent(ev, "compute stream")
        return DONE  # CPU compute is synchronous on the calling thread

    def wait(self, event: Event, what: str) -> None:
        if isinstance(event, CudaEvent):
            # The wait is queued, the host does not block: what it costs the compute stream is the
            # time between these two events (zero when the copy had already landed).
            stream = torch.cuda.current_stream(self.device)
            before = torch.cuda.Event(enable_timing=True)
            before.record(stream)
            stream.wait_event(event.event)
            after = torch.cuda.Event(enable_timing=True)
            after.record(stream)
            self._cuda_waits.add(before, after)
            return
        t0 = time.perf_counter()
        try:
            event.wait(self.watchdog_s)
        except WatchdogError as exc:
            raise WatchdogError(f"{exc} (compute stream blocked in {what})") from None
        self.wait_s += time.perf_counter() - t0

    def synchronize(self) -> None:
        for s in self.copy_streams():
            s.synchronize()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def reset_counters(self) -> None:
        for s in self.copy_streams():
            s.reset_counters()
        self.wait_s = 0.0
        if self._cuda_waits is not None:
            self._cuda_waits.reset()
