"""The side parameters: what a model trains beside its decoder layers, embedding, head and final norm (Gemma 3n's
and Gemma 4's per-layer input table and its projection). Counted once here, so the planner (planner/meta_shapes.py,
on a meta model) and the engine's device policy (engine/layer/tiling.py) count the same ones: their gradient comes
out dense, in the compute dtype, every micro-batch (engine/layer/side_inputs.py)."""

from __future__ import annotations

from .adapter import DecoderParts


def side_numel(parts: DecoderParts) -> int:
    """Parameters of `parts.model` outside its layers, embedding, head (a tied one is the embedding) and final norm."""
    counted = {id(p) for p in parts.layers.parameters()} | {id(parts.embed.weight)}
    if not parts.tied:
        counted.add(id(parts.lm_head.weight))
    if parts.norm is not None:
        counted |= {id(p) for p in parts.norm.parameters()}
    return sum(p.numel() for p in parts.model.parameters() if id(p) not in counted)
