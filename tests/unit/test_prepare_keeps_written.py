"""What the backend turns off on the way to the engine (pinning without CUDA, overlap for a later optimizer) is a
copy of the resolved settings: the engine's config still says what the user wrote (EngineConfig.written)."""

from __future__ import annotations

from conftest import tiny_model

from megatrain.backend import MegatrainBackend
from megatrain.config.schema import EngineConfig


def test_prepare_turns_settings_off_and_keeps_what_was_written():
    written = EngineConfig(device="cpu", compute_dtype="float32", pin_memory=True, parity_probe=False)
    backend = MegatrainBackend(config=written, mixed_precision=None)
    backend.prepare(tiny_model(layers=2, hidden=32, vocab=128), None)  # no optimizer yet: overlap "auto" is off
    config = backend.engine.config
    assert config.pin_memory is False and config.optimizer_overlap is False
    assert config.written["pin_memory"] is True and config.written["optimizer_overlap"] is None
    assert config.written == written.written
