"""Pinned host memory (engine/host/pinned.py, costs/pinning.py): exactly the copied buffers are pinned, the
preflight counts them to the byte, and a failed pin is an error. The CUDA registration is mocked on the CPU
(the calls are counted); the real path runs where CUDA exists."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from conftest import make_batches, tiny_model

from megatrain.config.schema import EngineConfig
from megatrain.costs.pinning import PAGE_BYTES, STAGING_SLOTS, mapped_bytes
from megatrain.engine import Engine
from megatrain.engine.host import pinned
from megatrain.engine.host.preflight import pinned_preflight
from megatrain.engine.pipeline.schedule import accumulate

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class FakeCuda:
    """Stands in for cudaHostRegister/Unregister: records what is pinned; can fail past a byte budget."""

    def __init__(self, budget: int | None = None) -> None:
        self.budget = budget
        self.live: dict[int, int] = {}
        self.registered = 0
        self._lock = threading.Lock()

    def register(self, ptr: int, nbytes: int) -> None:
        assert ptr % PAGE_BYTES == 0 and nbytes % PAGE_BYTES == 0, (ptr, nbytes)
        with self._lock:
            if self.budget is not None and self.registered + nbytes > self.budget:
                raise RuntimeError("cudaErrorMemoryAllocation (simulated)")
            self.live[ptr] = nbytes
            self.registered += nbytes

    def unregister(self, ptr: int) -> None:
        with self._lock:
            self.live.pop(ptr)


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeCuda()
    monkeypatch.setattr(pinned, "cuda_register", fake.register)
    monkeypatch.setattr(pinned, "cuda_unregister", fake.unregister)
    return fake


def _shapes(model):
    from megatrain.models.adapter import find_parts

    parts = find_parts(model)
    prefix = parts.layers_prefix + "."
    layers = [[(n, p.shape) for n, p in layer.named_parameters()] for layer in parts.layers]
    return layers, [p.shape for n, p in model.named_parameters() if not n.startswith(prefix)]


def test_host_buffer_is_page_aligned_zeroed_and_unregistered_when_freed(fake_cuda):
    p = pinned.Pinner()
    t = p.buffer(1000, torch.float32, "test")
    assert t.data_ptr() % PAGE_BYTES == 0 and t.numel() == 1000 and not t.any()
    assert p.pinned_bytes == mapped_bytes(4000) == PAGE_BYTES and fake_cuda.live == {t.data_ptr(): PAGE_BYTES}
    view = t[10:20]
    del t
    gc.collect()
    assert fake_cuda.live, "unregistered while a view still uses the memory"
    view.fill_(1.0)
    del view
    gc.collect()
    assert fake_cuda.live == {}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_pins_exactly_the_copied_buffers_and_the_preflight_counts_them(fake_cuda, dtype):
    model = tiny_model("llama", layers=3, hidden=48)
    layers, globs = _shapes(model)
    predicted = pinned_preflight(layers, globs, getattr(torch, dtype), staging=False)
    eng = Engine(model, EngineConfig(pin_memory=True, compute_dtype=dtype, device="cpu"))
    store = eng.store
    # The resident FP32 masters are copied from only in FP32 compute (bf16 uploads its own bf16 staging).
    copied = [g.stream_source for g in store.layers] + ([store.globals.master] if dtype == "float32" else [])
    assert sum(fake_cuda.live.values()) == sum(predicted.values()) == store.pinned_bytes
    assert set(fake_cuda.live) == {t.data_ptr() for t in copied}
    assert predicted["streamed layers"] == sum(mapped_bytes(g.numel * (2 if dtype == "bfloat16" else 4))
                                               for g in store.layers)
    # Negative control: what pinning every host buffer (the old rule) would have locked is more.
    everything = [b for g in store.groups() for b in (g.master, g.grad, g.shadow) if b is not None]
    assert sum(mapped_bytes(b.numel() * b.element_size()) for b in everything) > store.pinned_bytes
    assert all(g.grad.data_ptr() not in fake_cuda.live for g in store.groups())


def test_offloaded_activations_are_pinned_once_and_reused(fake_cuda):
    eng = Engine(tiny_model("llama", layers=3, hidden=32),
                 EngineConfig(pin_memory=True, device="cpu", offload_activations=True))
    before = dict(fake_cuda.live)
    batches = make_batches(3, seq=12, pad=False)
    for b in batches:
        eng.backward(eng(**b).loss)
    first = set(fake_cuda.live) - set(before)
    assert len(first) == 3 and eng.pipeline.act_pool.nbytes > 0  # one buffer per layer, not per batch
    for b in batches:
        eng.backward(eng(**b).loss)
    assert set(fake_cuda.live) - set(before) == first


def test_pinned_engine_trains_exactly_as_a_pageable_one(fake_cuda):
    batches = make_batches(3, seq=12)
    engines = [Engine(tiny_model("llama", layers=3, hidden=32), EngineConfig(pin_memory=pin, device="cpu"))
               for pin in (False, True)]
    for eng in engines:
        for b in batches:
            eng.backward(eng(**b).loss)
            eng.step()
            eng.zero_grad()
    for (n, a), (_, b) in zip(engines[0].named_parameters(), engines[1].named_parameters()):
        assert torch.equal(a, b), n


def test_a_failed_pin_is_an_error_naming_what_could_be_pinned(monkeypatch):
    model = tiny_model("llama", layers=4, hidden=64)
    layers, globs = _shapes(model)
    need = sum(pinned_preflight(layers, globs, torch.float32, staging=False).values())
    fake = FakeCuda(budget=need // 2)
    monkeypatch.setattr(pinned, "cuda_register", fake.register)
    monkeypatch.setattr(pinned, "cuda_unregister", fake.unregister)
    with pytest.raises(pinned.PinnedMemoryError) as info:
        Engine(model, EngineConfig(pin_memory=True, device="cpu"))
    msg = str(info.value)
    assert 0 < fake.registered <= need // 2
    assert f"could pin only {fake.registered / 2**30:.2f} GiB of the {need / 2**30:.2f} GiB" in msg
    assert "pin_memory=False" in msg and "ulimit -l" in msg and "simulated" in msg
    del info
    gc.collect()
    assert fake.live == {}  # what was pinned is released with the half-built store


def test_preflight_counts_the_staging_slots():
    layers = [[("w", torch.Size([100, 30]))], [("w", torch.Size([100, 50]))]]
    p = pinned_preflight(layers, [torch.Size([7, 3])], torch.bfloat16, staging=True)
    # bf16 on CUDA: the resident masters go up from a pinned bf16 copy (engine/host/resident_upload.py), so the
    # FP32 masters themselves are not pinned.
    assert p == {"streamed layers": mapped_bytes(6000) + mapped_bytes(10000),
                 "grad staging": STAGING_SLOTS * mapped_bytes(10000), "resident grad staging": PAGE_BYTES,
                 "resident upload staging": PAGE_BYTES}
    fp32 = pinned_preflight(layers, [torch.Size([7, 3])], torch.float32, staging=True)
    assert fp32 == {"streamed layers": mapped_bytes(12000) + mapped_bytes(20000), "resident masters": PAGE_BYTES,
                    "grad staging": STAGING_SLOTS * mapped_bytes(20000), "resident grad staging": PAGE_BYTES}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_resident_masters_are_pinned_only_where_the_upload_copies_from_them(fake_cuda, dtype):
    """bf16 compute: the resident upload reads its own bf16 staging, so the FP32 masters stay pageable
    (4 B per resident parameter not locked); FP32 compute: the masters are the upload's source, pinned."""
    from megatrain.engine.host.store import HostStore
    from megatrain.models.adapter import find_parts

    model = tiny_model("llama", layers=2, hidden=48)
    layers, _ = _shapes(model)
    prefix = find_parts(model).layers_prefix + "."
    named = [(n, p.shape) for n, p in model.named_parameters() if not n.startswith(prefix)]
    store = HostStore(layers, named, True, torch.bfloat16 if dtype == "bfloat16" else None)
    master = store.globals.master
    assert (master.data_ptr() in fake_cuda.live) == (dtype == "float32")
    assert all(g.stream_source.data_ptr() in fake_cuda.live for g in store.layers)
    eng = Engine(model, EngineConfig(pin_memory=True, compute_dtype=dtype, device="cpu"))
    assert (eng.store.globals.master.data_ptr() in fake_cuda.live) == (dtype == "float32")


def test_chunked_accumulate_is_bitwise_the_whole_add():
    g = torch.Generator().manual_seed(0)
    dst = torch.randn(73 * 137, generator=g)
    src = torch.randn(73 * 137, generator=g).to(torch.bfloat16)
    want = dst.clone().add_(src)
    for scratch in (torch.empty(997), None):  # a ragged last chunk; the default scratch
        got = dst.clone()
        accumulate(got, src, scratch)
        assert torch.equal(got, want)
    shaped = dst.clone().view(73, 137)  # a parameter's view of the slab: shape kept, chunks flat
    accumulate(shaped, src.view(73, 137), torch.empty(997))
    assert torch.equal(shaped.view(-1), want)
    short = dst.clone()  # negative control: a chunk left out is seen
    accumulate(short[:-5], src[:-5], torch.empty(997))
    assert not torch.equal(short, want)


@cuda
def test_cuda_engine_pins_what_the_preflight_predicts():
    model = tiny_model("llama", layers=3, hidden=64)
    layers, globs = _shapes(model)
    eng = Engine(model, EngineConfig(compute_dtype="bfloat16"))
    predicted = pinned_preflight(layers, globs, torch.bfloat16, staging=True)
    assert eng.store.pinned_bytes == sum(predicted.values())
    assert all(g.stream_source.is_pinned() for g in eng.store.layers) and not eng.store.globals.master.is_pinned()
    assert eng.placement.upload.staging.is_pinned()  # what the bf16 resident upload reads instead
    assert not any(g.grad.is_pinned() or g.master.is_pinned() for g in eng.store.layers)  # bf16: shadows stream


def test_the_planner_counts_pinned_bytes_by_the_engines_rule():
    from megatrain.costs.pinning import pinned_bytes
    from megatrain.planner import plan

    pl = plan("qwen2.5-72b", context=4096, batch=1, hardware="h200-pcie", dtype="bfloat16")
    m = pl.point.model
    rule = pinned_bytes([m.layer_params()] * m.num_layers, m.embed_params() + m.hidden, 2, True, 2)
    per_batch = pl.memory.host.get("offloaded activations", 0) + pl.memory.host["embedding row staging"]
    assert pl.memory.pinned == sum(rule.values()) + per_batch
    assert pl.memory.host["head gradient copy"] == rule["resident grad staging"]
    assert pl.memory.host["pinned grad staging"] == rule["grad staging"]
    assert pl.memory.host["resident upload staging"] == rule["resident upload staging"] > 0
    # The FP32 masters and gradient slabs are host-only in bf16 mode: well under half the host bytes are locked.
    assert pl.memory.pinned < 0.25 * pl.memory.host_total
    cpu = plan("qwen2.5-72b", context=4096, batch=1, hardware="cpu", dtype="bfloat16")
    assert cpu.memory.pinned == 0


def test_preflight_counts_the_staging_as_host_memory_on_cuda():
    from megatrain.engine.host.preflight import host_preflight

    layers = [[("w", torch.Size([100, 30]))], [("w", torch.Size([100, 50]))]]
    cpu = host_preflight(layers, [torch.Size([7, 3])], torch.bfloat16, available=10**12)
    gpu = host_preflight(layers, [torch.Size([7, 3])], torch.bfloat16, available=10**12, pin=True, staging=True)
    staged = pinned_preflight(layers, [torch.Size([7, 3])], torch.bfloat16, staging=True)
    assert gpu == {**cpu, "grad staging": staged["grad staging"], "resident grad staging": staged["resident grad staging"],
                   "resident upload staging": staged["resident upload staging"]}  # bf16: the masters' upload copy


class _FailingCudart:
    """torch.cuda.cudart() as torch binds it: cudaHostRegister and cudaHostUnregister, no cudaGetLastError."""

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:  # noqa: N802 - the CUDA name
        return 2  # cudaErrorMemoryAllocation


def test_a_failed_registration_clears_its_cuda_error(monkeypatch):
    # Left set, the error would surface at the next kernel launch as that kernel's own failure.
    cleared = []
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _FailingCudart())
    monkeypatch.setattr(pinned, "_loaded_cudart_symbol", lambda name: (lambda: cleared.append(name) or 0))
    with pytest.raises(RuntimeError, match="cudaHostRegister of 0.00 GiB failed: 2"):
        pinned.cuda_register(4096, 4096)
    assert cleared == ["cudaGetLastError"]  # through the loaded libcudart: torch's binding has no such call

    bound = _FailingCudart()
    bound.cudaGetLastError = lambda: cleared.append("bound") or 0
    monkeypatch.setattr(torch.cuda, "cudart", lambda: bound)
    with pytest.raises(RuntimeError):
        pinned.cuda_register(4096, 4096)
    assert cleared == ["cudaGetLastError", "bound"]  # a binding that has it is used first


def test_the_loaded_libcudart_lookup_never_loads_a_library():
    # RTLD_NOLOAD: on this CPU build no libcudart is loaded, so there is nothing to call (not a fresh copy).
    if torch.version.cuda is None:
        assert pinned._loaded_cudart_symbol("cudaGetLastError") is None
    assert pinned.clear_cuda_error(object()) is (pinned._loaded_cudart_symbol("cudaGetLastError") is not None)
