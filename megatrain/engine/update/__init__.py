"""The optimizer side: the update paths (whole step, per layer, in backward), the fused per-layer pass and
its compiled AdamW kernel.

The wings' order (each imports only its own and the ones before it) is docs/DESIGN.md's map, checked by
tests/unit/test_layering.py: runtime, host, layer, pipeline, update, parallel, model.
"""
