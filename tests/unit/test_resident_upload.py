"""The resident parameters' upload on CUDA in bf16 (engine/host/resident_upload.py), with the CUDA calls mocked: the
copy reads pinned bf16 staging, holds the bits `.to(torch.bfloat16)` gives, a refill waits for the previous copy,
and the staging is counted among the pinned bytes. A queued "device" runs the copies only when an event is
queried or the test drains it, so a copy reads its source late, as a DMA does."""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext

import pytest
import torch
from kit import bits
from test_pinned import FakeCuda

from megatrain.costs.pinning import mapped_bytes, pinned_bytes
from megatrain.engine.host import pinned, resident_upload
from megatrain.engine.host.preflight import host_preflight, pinned_preflight
from megatrain.engine.host.resident_upload import ResidentUpload
from megatrain.engine.host.store import HostStore

GLOBALS = [("embed", torch.Size([37, 16])), ("norm", torch.Size([16])), ("head", torch.Size([37, 16]))]
LAYERS = [[("w", torch.Size([16, 16]))]]


class FakeDevice:
    """Work queued on the fake streams, run in order when an event after it is queried (or on drain)."""

    def __init__(self) -> None:
        self.queued: list = []
        self.ran = 0

    def run_until(self, n: int) -> None:
        while self.ran < n:
            self.queued[self.ran]()
            self.ran += 1

    def drain(self) -> None:
        self.run_until(len(self.queued))


@pytest.fixture
def cuda(monkeypatch):
    device = FakeDevice()

    class FakeEvent:
        def __init__(self, enable_timing: bool = False) -> None:
            self.pos = None

        def record(self, stream=None) -> None:
            self.pos = len(device.queued)

        def query(self) -> bool:
            device.run_until(self.pos)
            return True

    class FakeStream:
        def __init__(self, device=None) -> None:
            self.waited_events: list = []
            self.waited_streams: list = []

        def wait_event(self, event) -> None:
            assert event.pos is not None, "a wait on an event never recorded"
            self.waited_events.append(event)

        def wait_stream(self, other) -> None:
            self.waited_streams.append(other)

    compute = FakeStream()
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda d: nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    sources: list[torch.Tensor] = []
    delivered: list[torch.Tensor] = []  # what each queued copy wrote, read when the device ran it

    def queued_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        sources.append(src)
        device.queued.append(lambda: delivered.append(dst.copy_(src).clone()))

    monkeypatch.setattr(resident_upload, "upload_copy", queued_copy)
    fake = FakeCuda()
    monkeypatch.setattr(pinned, "cuda_register", fake.register)
    monkeypatch.setattr(pinned, "cuda_unregister", fake.unregister)
    return device, compute, sources, delivered, fake


def _upload(seed: int = 0):
    store = HostStore(LAYERS, GLOBALS, True, torch.bfloat16)
    store.globals.master.copy_(torch.randn(store.globals.numel, generator=torch.Generator().manual_seed(seed)))
    targets = [torch.zeros(s.shape, dtype=torch.bfloat16) for s in store.globals.slots]  # the device copies
    return store, targets, ResidentUpload(store, targets, torch.bfloat16, torch.device("cuda"), 5.0)


def test_the_copy_reads_pinned_bf16_staging_ordered_between_the_compute_streams_work(cuda):
    device, compute, sources, _, fake = cuda
    store, targets, up = _upload()
    up.run()
    up.fence()  # what the next forward does first (the embedding's pre-hook, placement.py)
    base = up.staging.data_ptr()
    assert base in fake.live, "the staging buffer is not registered (pinned)"
    assert len(sources) == len(GLOBALS)
    for src in sources:
        assert src.dtype == torch.bfloat16 and base <= src.data_ptr() < base + fake.live[base]
        assert src.data_ptr() != store.globals.master.data_ptr()
    # the old values' readers queued before the run go first (an event recorded on the compute stream at run())
    assert len(up._stream.waited_events) == 1 and up._stream.waited_events[0].pos == 0
    assert compute.waited_events and compute.waited_events[-1] is up._copied.event  # and later compute after it
    assert device.ran == 0  # queued, not run on the caller's thread
    device.drain()
    for t, view in zip(targets, store.globals.views(store.globals.master).values()):
        assert torch.equal(bits(t.reshape(-1)), bits(view.to(torch.bfloat16).reshape(-1)))


def test_staging_bits_are_round_to_nearest_even_as_to_bfloat16(cuda):
    store, _, up = _upload()
    one = 1.0
    ties = [one + 2**-8, one + 3 * 2**-8, -(one + 2**-8), one + 2**-8 + 2**-20]  # half an ulp, and just above
    special = [float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-40, -1e-41, 3.4e38, 1.17e-38]
    m = store.globals.master
    m.copy_(torch.randn(m.numel(), generator=torch.Generator().manual_seed(3)) * 10.0 ** torch.randint(-30, 30, (m.numel(),)))
    m[: len(ties) + len(special)] = torch.tensor(ties + special)
    up.run()
    up.fence()
    assert torch.equal(bits(up.staging.reshape(-1)), bits(m.to(torch.bfloat16).reshape(-1)))
    # Independent of torch's conversion: ties go to the even neighbour, above a tie rounds up.
    assert up.staging[:4].tolist() == [1.0, 1.0 + 2**-6, -1.0, 1.0 + 2**-7]


def test_a_refill_waits_for_the_previous_copy(cuda, monkeypatch):
    device, _, _, delivered, _ = cuda
    store, targets, up = _upload()
    first = store.globals.master.to(torch.bfloat16)
    up.run()  # step 1's copy queued, not yet run by the device
    up.fence()  # the next forward (the embedding's pre-hook) comes before the next update
    store.globals.master.add_(1.0)  # step 2's update
    second = store.globals.master.to(torch.bfloat16)
    up.run()
    up.fence()
    device.drain()
    n = len(GLOBALS)
    assert torch.equal(torch.cat([d.reshape(-1) for d in delivered[:n]]), first)
    assert torch.equal(torch.cat([d.reshape(-1) for d in delivered[n:]]), second)


def test_negative_control_a_refill_without_the_wait_overwrites_the_copys_source(cuda, monkeypatch):
    device, _, _, delivered, _ = cuda
    store, _, up = _upload()
    monkeypatch.setattr(ResidentUpload, "_wait_free", lambda self: None)
    first = store.globals.master.to(torch.bfloat16)
    up.run()
    up.fence()
    store.globals.master.add_(1.0)
    up.run()
    up.fence()
    device.drain()
    got = torch.cat([d.reshape(-1) for d in delivered[: len(GLOBALS)]])
    assert not torch.equal(got, first)  # step 1's copy delivered step 2's values: the missing wait is caught


def test_the_staging_is_counted_among_the_pinned_bytes(cuda):
    store = HostStore(LAYERS, GLOBALS, True, torch.bfloat16)
    before = store.pinned_bytes
    ResidentUpload(store, [], torch.bfloat16, torch.device("cuda"), 5.0)
    globs = [s for _, s in GLOBALS]
    predicted = pinned_preflight(LAYERS, globs, torch.bfloat16, staging=True)
    numel = sum(s.numel() for s in globs)
    assert store.pinned_bytes - before == predicted["resident upload staging"] == mapped_bytes(numel * 2)
    assert "resident upload staging" not in pinned_preflight(LAYERS, globs, torch.float32, staging=True)
    assert "resident upload staging" not in pinned_preflight(LAYERS, globs, torch.bfloat16, staging=False)
    need = host_preflight(LAYERS, globs, torch.bfloat16, available=10**12, pin=True, staging=True)
    assert need["resident upload staging"] == predicted["resident upload staging"]
    assert pinned_bytes([256], numel, 2, True, 2)["resident upload staging"] == mapped_bytes(numel * 2)


def test_fp32_masters_at_fp32_compute_are_refused_a_staged_upload():
    store = HostStore(LAYERS, GLOBALS, False, None)
    with pytest.raises(ValueError, match="float32"):
        ResidentUpload(store, [], torch.float32, torch.device("cuda"), 5.0)


def _planted_slow_rounding(monkeypatch, seconds: float) -> list[int]:
    """The rounding, slowed down: which threads ran it."""
    threads: list[int] = []
    real = resident_upload.round_into

    def slow(staging: torch.Tensor, master: torch.Tensor) -> None:
        threads.append(threading.get_ident())
        time.sleep(seconds)
        real(staging, master)

    monkeypatch.setattr(resident_upload, "round_into", slow)
    return threads


def _next_forward_reads(device, targets) -> list[torch.Tensor]:
    """The next forward's first read of the resident parameters, queued on the (fake) compute stream."""
    seen: list[torch.Tensor] = []
    device.queued.append(lambda: seen.append(torch.cat([t.reshape(-1) for t in targets]).clone()))
    return seen


def test_the_rounding_runs_off_the_callers_thread_and_the_next_forward_waits_for_its_upload(cuda, monkeypatch):
    device, compute, _, _, _ = cuda
    store, targets, up = _upload()
    threads = _planted_slow_rounding(monkeypatch, 0.3)
    t0 = time.perf_counter()
    up.run()
    returned_s = time.perf_counter() - t0
    assert returned_s < 0.3  # the caller did not round (the rounding sleeps 0.3 s)
    up.fence()  # the embedding's pre-hook, before the forward's compute is queued
    seen = _next_forward_reads(device, targets)
    device.drain()
    assert threads and threads[0] != threading.get_ident()
    assert compute.waited_events[-1] is up._copied.event
    assert torch.equal(seen[0], store.globals.master.to(torch.bfloat16))  # the step's weights, bit for bit


def test_negative_control_without_the_fence_a_slow_rounding_leaves_the_forward_stale_weights(cuda, monkeypatch):
    device, _, _, _, _ = cuda
    store, targets, up = _upload()
    _planted_slow_rounding(monkeypatch, 0.3)
    monkeypatch.setattr(ResidentUpload, "fence", lambda self: None)
    up.run()
    seen = _next_forward_reads(device, targets)  # queued before the worker queued the copies
    device.drain()
    assert not torch.equal(seen[0], store.globals.master.to(torch.bfloat16))  # stale (the zeros before the upload)
    up._worker.shutdown(wait=True)


def test_the_embeddings_pre_hook_fences_and_copies_of_the_model_drop_it():
    import copy
    import pickle

    from megatrain.engine.model.placement import UploadFence

    calls: list[int] = []

    class Placed:
        def fence_upload(self) -> None:
            calls.append(1)

    placed = Placed()
    emb = torch.nn.Embedding(5, 3)
    emb.register_forward_pre_hook(UploadFence(placed))
    emb(torch.tensor([1]))
    assert calls == [1]
    for other in (copy.deepcopy(emb), pickle.loads(pickle.dumps(emb))):
        other(torch.tensor([1]))
    assert calls == [1]  # a copy has no engine to fence


def test_the_rounding_runs_on_a_side_share_of_the_cores(cuda, monkeypatch):
    """Beside the layer updates' workers the rounding takes a side share (stream.side_threads), set on its worker:
    not torch's whole team, nor a launcher's OMP_NUM_THREADS=1 (here the caller's count)."""
    import os

    from megatrain.engine.runtime import stream, threads

    before = torch.get_num_threads()
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv(threads.OVERRIDE_ENV, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)))
    seen: list[int] = []
    real = resident_upload.round_into
    monkeypatch.setattr(resident_upload, "round_into", lambda s, m: (seen.append(torch.get_num_threads()), real(s, m)))
    torch.set_num_threads(1)
    try:
        _, _, up = _upload()
        up.run()
        up.fence()
    finally:
        torch.set_num_threads(before)
    assert up.threads == stream.side_threads() == 8
    assert seen == [8]


def test_close_finishes_the_last_run_then_lets_the_staging_and_worker_go(cuda):
    """When the resident parameters' optimizer goes to the device (update/resident.py place_globals) the engine
    closes the upload: the run already queued is fenced first, the pinned staging is let go (unregistered) and the
    worker stops (a later run is refused, not silently dropped)."""
    device, compute, sources, _, fake = cuda
    _, _, up = _upload()
    up.run()
    base = up.staging.data_ptr()
    up.close()
    assert len(sources) == len(GLOBALS) and compute.waited_events  # the queued run was rounded, queued and fenced
    assert up.staging is None
    device.drain()  # the device ran the copies: nothing reads the staging any more
    device.queued, device.ran = [], 0
    sources.clear()
    import gc

    gc.collect()
    assert base not in fake.live  # unregistered once nothing holds it
    with pytest.raises(RuntimeError):
        up.run()
