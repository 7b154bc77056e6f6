"""Configuration: the settings as written, and the plan one engine settles them into.

- `schema.py`: `EngineConfig`, the engine's settings as written, one typed, frozen object (each setting, its default and
  why); its settled types, `ResolvedConfig` (a face's arguments folded in) and `EnginePlan` (every choice made); the
  word `AUTO` (defined once, in costs/residency.py) and the questions about it, which only this package asks.
- `settings.py`: the one reader of a config's sections (the face's keys, clipping, bf16, the planner's knobs).
- `resolve.py`: a face's arguments and a config -> the settings a run uses (`resolve`).
- `settle.py`: the settings -> one engine's plan (`settle_engine`, from `EngineFacts`: the device, the optimizer, the
  model's host bytes), once per engine build before it builds anything; the planner calls it too.
- `validate.py`: key and value checks (did-you-mean included).
"""

from .schema import AUTO, ENGINE_KEYS, EngineConfig, EnginePlan, ResolvedConfig, auto_or, rule_or

__all__ = ["AUTO", "ENGINE_KEYS", "EngineConfig", "EnginePlan", "ResolvedConfig", "auto_or", "rule_or"]
