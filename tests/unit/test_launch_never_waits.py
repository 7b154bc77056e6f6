"""The launch thread does not block on host work when it queues a device copy (CUDA calls mocked).

With optimizer_overlap a layer's weight load waits for that layer's update on the optimizer thread. On CUDA the
copy stream's submit used to `host_wait` for it on the launch thread, so the compute of the layers before it
was queued only after the host finished. Now the copy stream's helper thread queues the copy once the update
is done; the returned event is recorded then, and only whoever needs it waits."""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext

import pytest
import torch

from megatrain.engine.runtime import stream as stream_mod
from megatrain.engine.runtime.stream import DONE, CopyStream, Trace

HOST_S = 0.4  # the host job's length: a blocking submit would take at least this long


class FakeEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        self.recorded = False

    def record(self, stream=None) -> None:
        self.recorded = True

    def query(self) -> bool:
        return self.recorded


class FakeStream:
    def __init__(self, device=None) -> None:
        self.waits: list = []

    def wait_event(self, event) -> None:
        assert event.recorded, "a device stream waited on an event never recorded: the ordering would be lost"
        self.waits.append(event)


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda d: nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(stream_mod._CudaSpans, "add", lambda self, a, b: None)


def _host_job(order: list[str]):
    host = CopyStream("optimizer", torch.device("cpu"), Trace(False), None, 30.0)
    host.stall_s = HOST_S
    return host.submit(lambda: (order.append("update"), 0)[1], DONE, "adam", 0)


def test_a_copy_behind_host_work_is_queued_by_the_copy_stream_not_the_launch_thread(fake_cuda):
    order: list[str] = []
    h2d = CopyStream("h2d", torch.device("cuda"), Trace(False), None, 30.0)
    updated = _host_job(order)
    t0 = time.perf_counter()
    loaded = h2d.submit(lambda: (order.append(f"load on {threading.current_thread().name}"), 4)[1],
                        (updated,), "load", 0)
    nxt = h2d.submit(lambda: (order.append("next load"), 4)[1], DONE, "load", 1)  # stays behind it (FIFO)
    order.append("compute queued")  # what the launch thread does next
    submit_s = time.perf_counter() - t0
    assert submit_s < HOST_S / 2, f"the launch thread blocked {submit_s:.2f}s in submit"
    FakeStream().wait_event(loaded.event)  # the compute stream's wait: blocks only until the copy is queued
    nxt.host_wait(30.0)
    assert order[0] == "compute queued" and order[1] == "update", order
    assert order[2].startswith("load on megatrain-h2d-defer") and order[3] == "next load", order


def test_negative_control_a_submit_that_waits_on_the_launch_thread_is_caught(fake_cuda):
    """The same submit made to take the direct route (the host event claims to be done, so the stream's
    enqueue host-waits for it on the caller's thread, as every submit used to): the timing check sees it."""
    order: list[str] = []
    h2d = CopyStream("h2d", torch.device("cuda"), Trace(False), None, 30.0)
    updated = _host_job(order)
    updated.done = lambda: True
    t0 = time.perf_counter()
    h2d.submit(lambda: (order.append("load"), 4)[1], (updated,), "load", 0)
    assert time.perf_counter() - t0 >= HOST_S / 2
    assert order == ["update", "load"]


def test_a_failed_host_job_surfaces_at_the_wait(fake_cuda):
    h2d = CopyStream("h2d", torch.device("cuda"), Trace(False), None, 30.0)
    host = CopyStream("optimizer", torch.device("cpu"), Trace(False), None, 30.0)
    host.stall_s = 0.1
    bad = host.submit(lambda: (_ for _ in ()).throw(ValueError("planted")), DONE, "adam", 0)
    ev = h2d.submit(lambda: 4, (bad,), "load", 0)
    with pytest.raises(RuntimeError, match="planted"):
        ev.host_wait(30.0)
    host.synchronize = lambda: None  # the planted failure is this test's, not one to report at exit
