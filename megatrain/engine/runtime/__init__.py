"""The runtime: copy streams and events, the host threads and their teams, device resolution, host-copy
and allocator helpers, memory tracking, and the C build the host kernels share. Imports no other wing.

The wings' order (each imports only its own and the ones before it) is docs/DESIGN.md's map, checked by
tests/unit/test_layering.py: runtime, host, layer, pipeline, update, parallel, model.
"""
