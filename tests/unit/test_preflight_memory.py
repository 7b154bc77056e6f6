"""The host-memory preflight's reading of what is available (costs/host_memory.py, engine/host/preflight.py): a
container's reclaimable page cache is not counted as used, and the model's own host bytes, which placement
frees as it packs them, are credited to the store (except to its pinned share, touched while the model is
still whole). Cgroup and meminfo files are fakes in a temporary folder."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import tiny_model

from megatrain.config.schema import EngineConfig
from megatrain.costs import host_memory
from megatrain.engine import Engine, HostMemoryError
from megatrain.engine.host import pinned, preflight
from megatrain.models.adapter import find_parts

GIB = 2**30


def _fake_host(tmp_path, *, v1: bool = False, limit: int, usage: int, inactive: int | None,
               mem_available: int = 64 * GIB):
    tmp_path.mkdir(parents=True, exist_ok=True)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {128 * GIB // 1024} kB\nMemAvailable: {mem_available // 1024} kB\n")
    root, proc = tmp_path / "cg", tmp_path / "cgroup"
    if v1:
        base = root / "memory" / "job"
        proc.write_text("7:memory:/job\n")
        names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    else:
        base = root / "job"
        proc.write_text("0::/job\n")
        names = ("memory.max", "memory.current", "inactive_file")
    base.mkdir(parents=True)
    (base / names[0]).write_text(f"{limit}\n")
    (base / names[1]).write_text(f"{usage}\n")
    if inactive is not None:  # memory.stat as the kernel writes it: other keys around the one that counts
        extra = "inactive_file 1\n" if v1 else ""
        (base / "memory.stat").write_text(f"anon 123\nfile {inactive + 5}\n{extra}{names[2]} {inactive}\n"
                                          "active_file 5\n")
    return meminfo, root, proc


@pytest.mark.parametrize("v1", [False, True], ids=["cgroup-v2", "cgroup-v1"])
def test_reclaimable_page_cache_is_not_counted_as_used(tmp_path, monkeypatch, v1):
    files = _fake_host(tmp_path, v1=v1, limit=8 * GIB, usage=7 * GIB, inactive=5 * GIB)
    hm = host_memory.host_memory_available(*files)
    assert hm.available_bytes == 6 * GIB  # 8 - (7 - 5): the 5 GiB of cached file pages are reclaimable
    assert "page cache" in hm.source
    # The engine's preflight reads the same figure (it used to read memory.current as all used: 1 GiB).
    monkeypatch.setattr(host_memory, "host_memory_available", functools.partial(host_memory.host_memory_available, *files))
    assert preflight.available_host_bytes() == 6 * GIB


def test_without_a_memory_stat_the_usage_counts_whole_and_meminfo_still_caps(tmp_path):
    files = _fake_host(tmp_path, limit=8 * GIB, usage=7 * GIB, inactive=None)
    assert host_memory.host_memory_available(*files).available_bytes == 1 * GIB
    files = _fake_host(tmp_path / "b", limit=8 * GIB, usage=7 * GIB, inactive=5 * GIB, mem_available=3 * GIB)
    assert host_memory.host_memory_available(*files).available_bytes == 3 * GIB  # the host has less than the group


def test_model_host_bytes_counts_each_storage_once_and_nothing_on_meta():
    model = tiny_model("llama", layers=2, hidden=64, tied=True)
    want = sum(p.numel() * 4 for p in model.parameters())  # parameters() lists the tied weight once
    assert preflight.model_host_bytes([p for _, p in model.named_parameters(remove_duplicate=False)]) == want
    with torch.device("meta"):
        meta = tiny_model("llama", layers=2, hidden=64)
    assert preflight.model_host_bytes(list(meta.parameters())) == 0


def _need(model, dtype=torch.float32, **kw) -> int:
    parts = find_parts(model)
    prefix = parts.layers_prefix + "."
    layers = [[(n, p.shape) for n, p in layer.named_parameters()] for layer in parts.layers]
    globs = [p.shape for n, p in model.named_parameters() if not n.startswith(prefix)]
    return sum(preflight.host_preflight(layers, globs, dtype, available=2**62, **kw).values())


def test_the_models_own_bytes_are_credited_to_the_store(monkeypatch):
    model = tiny_model("llama", layers=2, hidden=64)
    need, own = _need(model), preflight.model_host_bytes(list(model.parameters()))
    assert 0 < own < need
    # Fits only with the model's bytes counted: refused before, built now.
    monkeypatch.setattr(preflight, "available_host_bytes", lambda: need - own // 2)
    eng = Engine(model, EngineConfig(device="cpu"))
    assert eng.store.host_bytes() > 0
    # Control: short of even that, refused, and the message says what was credited.
    monkeypatch.setattr(preflight, "available_host_bytes", lambda: need - own - 4096)
    with pytest.raises(HostMemoryError, match=r"plus the model's own 0\.00 GiB that placement frees"):
        Engine(tiny_model("llama", layers=2, hidden=64), EngineConfig(device="cpu"))


def test_the_pinned_share_gets_no_credit(monkeypatch):
    monkeypatch.setattr(pinned, "cuda_register", lambda ptr, n: None)
    monkeypatch.setattr(pinned, "cuda_unregister", lambda ptr: None)
    model = tiny_model("llama", layers=2, hidden=64)
    parts = find_parts(model)
    prefix = parts.layers_prefix + "."
    layers = [[(n, p.shape) for n, p in layer.named_parameters()] for layer in parts.layers]
    globs = [p.shape for n, p in model.named_parameters() if not n.startswith(prefix)]
    pinned_bytes = sum(preflight.pinned_preflight(layers, globs, torch.float32, staging=False).values())
    need = _need(model)
    # Enough with the credit for the whole store, yet less than the pinned share alone: refused.
    with pytest.raises(HostMemoryError, match="pinned while the model is still whole"):
        preflight.host_preflight(layers, globs, torch.float32, available=pinned_bytes - 1, pin=True,
                                 freed=need)
    assert preflight.host_preflight(layers, globs, torch.float32, available=pinned_bytes, pin=True, freed=need)
