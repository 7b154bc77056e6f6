"""Worker threads make their CUDA calls on the engine's device (CUDA mocked: a per-thread current device that
starts at 0 in every new thread, as CUDA's does)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from megatrain.engine.host import pinned


class FakeDevices:
    def __init__(self) -> None:
        self.local = threading.local()
        self.seen: list[int] = []

    def current_device(self) -> int:
        return getattr(self.local, "device", 0)

    def set_device(self, d: int) -> None:
        self.local.device = d

    def register(self, ptr: int, nbytes: int) -> None:
        self.seen.append(self.current_device())


@pytest.fixture
def devices(monkeypatch):
    fake = FakeDevices()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", fake.current_device)
    monkeypatch.setattr(torch.cuda, "set_device", fake.set_device)
    monkeypatch.setattr(pinned, "cuda_register", fake.register)
    monkeypatch.setattr(pinned, "cuda_unregister", lambda ptr: None)
    return fake


def test_the_pin_pool_registers_on_the_callers_device(devices):
    devices.set_device(3)  # the engine's cuda:3, set on the calling thread
    p = pinned.Pinner(threads=4)
    p.pin([pinned.host_buffer(1000, torch.float32) for _ in range(9)], "test buffers")
    assert devices.seen == [3] * 9


def test_negative_control_a_fresh_thread_is_on_device_0(devices):
    """What the pool's threads did before: a new thread's calls land on GPU 0."""
    devices.set_device(3)
    with ThreadPoolExecutor(2) as pool:
        pool.submit(devices.register, 0, 0).result()
    assert devices.seen == [0]
