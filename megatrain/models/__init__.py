"""Model descriptions: presets (pure data) and the HF adapter (`megatrain.models.adapter`, needs torch)."""

from .presets import ALIASES, PRESETS, ModelPreset, get_preset

__all__ = ["ALIASES", "PRESETS", "ModelPreset", "get_preset"]
