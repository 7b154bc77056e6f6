"""Positions and lengths are refused with a ValueError before the device sees them (engine/layer/batch.py): a
sequence longer than the model's positions by its shape alone, whatever the batch's device; position_ids a collator
built in host memory, at once, beside device ids; device position_ids past the table made indexable until verify()
refuses them (a learned position table indexed past its end is a device-side assert that poisons the CUDA context).
The meta device stands in for the GPU: reading any of its values raises."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config, tiny_model

from megatrain.config.schema import EngineConfig
from megatrain.engine import Engine
from megatrain.engine.layer import batch as B

MAX_POS = 32


def _cfg():
    return tiny_config("llama", max_pos=MAX_POS)


def _ids(seq: int, device: str = "cpu") -> torch.Tensor:
    return torch.randint(3, 200, (2, seq)).to(device)


def test_a_too_long_device_batch_is_refused_by_its_shape_before_any_device_work(monkeypatch):
    queued = []
    monkeypatch.setattr(B, "to_host", lambda t: (queued.append(t), t)[1])  # a queued read back: device work
    ids = _ids(MAX_POS + 8, "meta")
    with pytest.raises(ValueError, match=f"sequence length {MAX_POS + 8} exceeds the model's "
                                         f"max_position_embeddings={MAX_POS}"):
        B.check_batch(_cfg(), ids, None, ids, None, {})
    assert queued == []  # refused before any read back was queued
    # control: at the limit it is queued as any device batch is (the old path for the too-long one too)
    assert isinstance(B.check_batch(_cfg(), _ids(MAX_POS, "meta"), None, _ids(MAX_POS, "meta"), None, {}),
                      B.PendingCheck)


def test_host_position_ids_beside_device_ids_are_checked_at_once(monkeypatch):
    monkeypatch.setattr(B, "to_host", lambda t: t)  # the device parts' read back, queued (meta cannot copy)
    ids = _ids(16, "meta")
    pos = torch.arange(16).expand(2, 16) + MAX_POS  # a packing collator's bad offsets, in host memory
    with pytest.raises(ValueError, match=f"position {MAX_POS + 15} exceeds"):
        B.check_batch(_cfg(), ids, None, None, pos, {})
    with pytest.raises(ValueError, match="position_ids must be >= 0, got -3"):
        B.check_batch(_cfg(), ids, None, None, torch.arange(16).expand(2, 16) - 3, {})
    assert isinstance(B.check_batch(_cfg(), ids, None, None, torch.arange(16).expand(2, 16), {}), B.PendingCheck)


def test_device_position_ids_past_the_table_are_indexable_until_verify_refuses_them():
    cfg = _cfg()
    ids, pos = _ids(16), torch.arange(16).expand(2, 16) + MAX_POS
    pending = B.check_batch(cfg, ids, None, None, pos, {}, defer=True)  # as a device batch is
    safe = pending.sanitize_positions(pos)
    assert int(safe.max()) == MAX_POS - 1 and int(safe.min()) >= 0
    torch.nn.Embedding(MAX_POS, 4)(safe)  # a learned position table takes them
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        pending.verify()
    good = torch.arange(16).expand(2, 16)
    assert torch.equal(B.check_batch(cfg, ids, None, None, good, {}, defer=True).sanitize_positions(good), good)
    assert pending.sanitize_positions(None) is None


def test_the_engine_refuses_a_too_long_batch_before_any_device_work():
    eng = Engine(tiny_model("llama", max_pos=MAX_POS), EngineConfig(device="cpu", parity_probe=False))
    eng.reset_stats()
    ids = _ids(MAX_POS + 1)
    with pytest.raises(ValueError, match=f"sequence length {MAX_POS + 1} exceeds"):
        eng(input_ids=ids, labels=ids)
    st = eng.collect_stats()
    assert st["h2d_bytes"] == 0 and st["tokens"] == 0  # no layer was loaded, no token counted
    loss = eng(input_ids=_ids(MAX_POS), labels=_ids(MAX_POS)).loss  # the engine is fine after it
    assert torch.isfinite(loss)


def test_a_deferred_batch_with_positions_past_a_learned_table_is_refused_not_faulted(monkeypatch):
    """GPT-2's learned position table (n_positions rows): a device batch's position_ids past it are clamped into
    the table until verify() refuses the batch with a ValueError. The CPU stands in for the device (its embedding
    raises IndexError where a GPU's asserts); deferring the check is what a device batch gets."""
    import transformers

    import megatrain.engine.engine as E

    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=MAX_POS, vocab_size=256)
    torch.manual_seed(0)
    eng = Engine(transformers.GPT2LMHeadModel(cfg), EngineConfig(device="cpu", parity_probe=False))
    real = E.check_batch
    monkeypatch.setattr(E, "check_batch", lambda *a: real(*a, defer=True))
    ids = torch.randint(3, 200, (2, 16))
    pos = torch.arange(16).expand(2, 16) + MAX_POS  # a packing collator's bad offsets
    with pytest.raises(ValueError, match=f"position {MAX_POS + 15} exceeds"):
        eng(input_ids=ids, labels=ids, position_ids=pos)
    # negative control: the same forward with the clamp undone faults in the table's lookup first
    monkeypatch.setattr(B.PendingCheck, "sanitize_positions", lambda self, p: p)
    with pytest.raises(IndexError):
        eng(input_ids=ids, labels=ids, position_ids=pos)
