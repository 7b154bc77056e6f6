"""Configuration: every setting, read once and resolved once.

- `schema.py`: `EngineConfig`, the engine's settings as one typed, frozen object (each setting, its default and why).
- `settings.py`: the one reader of a config's sections (the face's keys, clipping, bf16, the planner's knobs).
- `resolve.py`: a face's arguments and a config -> the settings a run uses (`resolve`), then the engine's device-
  and optimizer-dependent "auto" settled once per engine build (`settle_engine`; the planner calls it too).
- `validate.py`: key and value checks (did-you-mean included).
"""

from .schema import AUTO, ENGINE_KEYS, EngineConfig, auto_or, left_auto

__all__ = ["AUTO", "ENGINE_KEYS", "EngineConfig", "auto_or", "left_auto"]
