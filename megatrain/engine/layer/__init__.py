"""One layer's compute: the stateless templates weights are bound into, attention and its tiling, the tiled
MLP, the MoE router, the embedding and the chunked head and loss. Imports the runtime and the host tier.

The wings' order (each imports only its own and the ones before it) is docs/DESIGN.md's map, checked by
tests/unit/test_layering.py: runtime, host, layer, pipeline, update, parallel, model.
"""
