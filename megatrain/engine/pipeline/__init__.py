"""The layer pipeline: the forward/backward schedule over streamed layers, the activations kept for
backward, the resident parameters' gradients and the no-grad (inference) route.

The wings' order (each imports only its own and the ones before it) is docs/DESIGN.md's map, checked by
tests/unit/test_layering.py: runtime, host, layer, pipeline, update, parallel, model.
"""
