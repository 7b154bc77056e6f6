"""How many positions a model's RoPE is defined for, read off its config (torch-free: the planner reads it too)."""

from __future__ import annotations

from typing import Any


def max_trainable_positions(config: Any) -> int | None:
    """Positions the model's RoPE is defined for: max_position_embeddings, or the scaled original length
    when rope_parameters / rope_scaling extends it (linear, dynamic, yarn, llama3, longrope: factor x
    original_max_position_embeddings). None when the config states no limit."""
    max_pos = getattr(config, "max_position_embeddings", None)
    if max_pos is None:
        return None
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope and all(isinstance(v, dict) for v in rope.values()):  # per layer type: the tightest one
        return min(_scaled_limit(max_pos, v) for v in rope.values())
    return _scaled_limit(max_pos, rope)


def _scaled_limit(max_pos: int, rope: dict) -> int:
    if rope.get("rope_type", rope.get("type", "default")) in (None, "default"):
        return max_pos
    factor = float(rope.get("factor") or 1.0)
    original = rope.get("original_max_position_embeddings") or max_pos
    return max(max_pos, int(original * factor))
