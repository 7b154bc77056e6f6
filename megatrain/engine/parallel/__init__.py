"""Data parallelism: the ranks' process group, shared or per-rank host stores and the gradient reductions
across ranks.

The wings' order (each imports only its own and the ones before it) is docs/DESIGN.md's map, checked by
tests/unit/test_layering.py: runtime, host, layer, pipeline, update, parallel, model.
"""
