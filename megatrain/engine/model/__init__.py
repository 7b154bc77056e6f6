"""The user's model: its placement into the host store and the device, the model object the faces hand
back (forward, state_dict, generate), and the parity probe that proves an architecture trains exactly.

The wings' order (each imports only its own and the ones before it) is docs/DESIGN.md's map, checked by
tests/unit/test_layering.py: runtime, host, layer, pipeline, update, parallel, model.
"""
