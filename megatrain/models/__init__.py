from .adapter import DecoderParts, find_parts
from .presets import PRESETS, ModelPreset, get_preset

__all__ = ["DecoderParts", "find_parts", "PRESETS", "ModelPreset", "get_preset"]
