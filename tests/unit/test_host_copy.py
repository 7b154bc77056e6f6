"""Small per-micro-batch host tensors reach a CUDA device through pinned memory (engine/runtime/host_copy.py): a copy
from pageable memory makes the host wait for the device even with non_blocking=True. Checked with the CUDA
calls mocked (no GPU here), and that the engine's batch and loss tensors take that way."""

from __future__ import annotations

import torch
from conftest import make_batches, tiny_model

from megatrain.config.schema import EngineConfig
from megatrain.engine import Engine
from megatrain.engine import engine as engine_mod
from megatrain.engine.layer import loss
from megatrain.engine.runtime import host_copy

CUDA = torch.device("cuda")


def _mock_cuda(monkeypatch) -> list[tuple]:
    """Pinning and copies to a CUDA device, recorded instead of run."""
    calls: list[tuple] = []
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a: getattr(self, "_pinned", False))

    def pin(self):
        out = self.clone()
        out._pinned = True
        calls.append(("pin", self.dtype))
        return out

    orig_to = torch.Tensor.to

    def to(self, *a, **k):
        if a and isinstance(a[0], torch.device) and a[0].type == "cuda":
            calls.append(("copy", getattr(self, "_pinned", False), k.get("non_blocking", False)))
            return self
        return orig_to(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    monkeypatch.setattr(torch.Tensor, "to", to)
    return calls


def test_a_pageable_tensor_is_pinned_then_copied_without_blocking(monkeypatch):
    calls = _mock_cuda(monkeypatch)
    out = host_copy.to_device(torch.tensor([[1, 2, 3]], dtype=torch.int32), CUDA, torch.long)
    assert calls == [("pin", torch.long), ("copy", True, True)]  # converted on the host, then pinned, then queued
    assert out.dtype == torch.long


def test_a_pinned_tensor_is_not_pinned_again(monkeypatch):
    calls = _mock_cuda(monkeypatch)
    t = torch.zeros(4)
    t._pinned = True
    host_copy.to_device(t, CUDA)
    assert calls == [("copy", True, True)]


def test_negative_control_the_plain_call_copies_from_pageable_memory(monkeypatch):
    """What the engine did before: the detector above sees the copy leave unpinned memory."""
    calls = _mock_cuda(monkeypatch)
    torch.tensor([1, 2]).to(CUDA, non_blocking=True)
    assert calls == [("copy", False, True)]


def test_the_engines_batch_and_loss_tensors_take_the_pinned_way(monkeypatch):
    """On the CPU the helper is a plain copy; here it only records that the forward and the loss call it for the
    batch's ids, mask and positions and for the loss's token indices and targets."""
    seen = []

    def record(t, dev, dtype=None):
        seen.append(t.dtype if dtype is None else dtype)
        return host_copy.to_device(t, dev, dtype)

    monkeypatch.setattr(engine_mod, "to_device", record)
    monkeypatch.setattr(loss, "to_device", record)
    eng = Engine(tiny_model("llama", layers=1), EngineConfig())
    batch = make_batches(1)[0]
    batch["position_ids"] = torch.arange(batch["input_ids"].shape[1])[None].expand_as(batch["input_ids"])
    eng(**batch).loss.item()
    assert seen.count(torch.long) >= 3 and len(seen) >= 4, seen
