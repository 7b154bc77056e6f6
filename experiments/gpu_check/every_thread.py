"""A torch dispatch mode (the CUDA stream sanitizer's) on every thread, not only the one that entered it.

A dispatch mode lives on its thread's mode stack: the sanitizer, entered on the main thread, never sees a
kernel or copy issued by another one, and with the optimizer overlapped most layer loads are queued by the
copy stream's deferred-copy thread. Here each thread started inside `every_thread(mode)` runs under a thin
mode of its own that hands every op to the shared one, and the shared mode's bookkeeping is serialized:
an op and its record are one step, and the sanitizer's stream and event callbacks (which fire on whichever
thread records or waits) take the same lock, so the order it records is the order the work was queued in.

A host thread that polls an event (`query()` until True, as the engine's host waits do) has synchronized with
it as surely as one that called `synchronize()`, but torch reports only the latter to the sanitizer: inside
`every_thread` a query that returns True is reported as that synchronization too, so a host write after such
a wait is not flagged as a race with the copy it waited for.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any


def _delegate_mode(shared: Any, seen: Counter, lock: threading.RLock) -> Any:
    from torch.utils._python_dispatch import TorchDispatchMode  # here: torch is the phase process's import

    class Delegate(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            with lock:
                seen[threading.current_thread().name] += 1
                return type(shared).__torch_dispatch__(shared, func, types, args, kwargs)

    return Delegate()


def _trace_registries() -> list[Any]:
    try:
        from torch.cuda import _gpu_trace
    except ImportError:
        return []
    return [v for v in vars(_gpu_trace).values() if hasattr(v, "callback_list")]


def sync_on_query(cls: type, registry: Any, id_attr: str) -> Any:
    """Make `cls.query()` (an event's or a stream's) fire `registry`'s synchronization callbacks with the
    object's id whenever it returns True; returns the undo."""
    query = cls.__dict__.get("query")
    base = cls.query

    def reporting_query(self: Any) -> bool:
        done = base(self)
        if done:
            registry.fire_callbacks(getattr(self, id_attr))
        return done

    cls.query = reporting_query

    def undo() -> None:
        if query is not None:
            cls.query = query
        else:
            del cls.query

    return undo


def _query_syncs() -> list[Any]:
    try:
        import torch
        from torch.cuda import _gpu_trace
    except ImportError:
        return []
    return [sync_on_query(torch.cuda.Event, _gpu_trace.EventSynchronizationCallbacks, "cuda_event"),
            sync_on_query(torch.cuda.Stream, _gpu_trace.StreamSynchronizationCallbacks, "cuda_stream")]


@contextlib.contextmanager
def every_thread(shared: Any) -> Iterator[Counter]:
    """Inside: `shared` (a TorchDispatchMode already entered on this thread) also sees the ops of every thread
    started here. Yields the count of ops each other thread handed it, by thread name."""
    lock = threading.RLock()
    seen: Counter = Counter()
    cls = type(shared)
    own_dispatch = cls.__dict__.get("__torch_dispatch__")
    base_dispatch = cls.__torch_dispatch__

    def locked_dispatch(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        with lock:
            return base_dispatch(self, func, types, args, kwargs)

    def locked(cb: Any) -> Any:
        def call(*a: Any) -> None:
            with lock:
                cb(*a)

        return call

    run = threading.Thread.run

    def run_under_mode(thread: threading.Thread) -> None:
        with _delegate_mode(shared, seen, lock):
            run(thread)

    registries = _trace_registries()
    saved = [list(r.callback_list) for r in registries]
    cls.__torch_dispatch__ = locked_dispatch
    threading.Thread.run = run_under_mode
    for r in registries:
        r.callback_list[:] = [locked(cb) for cb in r.callback_list]
    undo_queries = _query_syncs()
    try:
        yield seen
    finally:
        for undo in undo_queries:
            undo()
        threading.Thread.run = run
        if own_dispatch is not None:
            cls.__torch_dispatch__ = own_dispatch
        else:
            del cls.__torch_dispatch__
        for r, cbs in zip(registries, saved):
            r.callback_list[:] = cbs
