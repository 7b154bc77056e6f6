"""The host tier: the store of FP32 masters (or hi/lo halves), gradient slabs and Adam state, its pinned and
NUMA-placed memory, the NVMe spill, the per-layer events that order jobs on those slabs, loading and the
host-memory preflight. Imports the runtime only.

The wings' order (each imports only its own and the ones before it) is docs/DESIGN.md's map, checked by
tests/unit/test_layering.py: runtime, host, layer, pipeline, update, parallel, model.
"""
