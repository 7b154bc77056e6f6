"""What a training point costs, in plain arithmetic with no torch import: one definition that the engine runs
by and the planner (`megatrain plan`) predicts with, so a plan and a run cannot disagree.

    modes     host-memory modes: what a master value and a gradient slab are made of, bytes per parameter
    memory    the device-memory model of one batch and the per-batch plan (sequence tile, loss chunk, offload)
    pinning   which host buffers are pinned, and exactly how many bytes that locks
    pipeline  the layer pipeline's issue order (weight copies, activations, gradients, compute)
    rollback  the speculative step's rollback budget: how many layers' copies fit beside the run's state
"""
