"""The speculative step's rollback budget: how many layers' rollback copies the host holds beside the run's state.
One rule for the engine (engine/update/speculative.py resolve, measured free memory) and the planner (planner/point.py,
the host's memory less what the run holds), so the count a plan predicts is the count a run takes."""

from __future__ import annotations

from collections.abc import Sequence

# Host bytes the copies leave free: the engine's measure is the process's headroom (cgroup, MemAvailable), and an
# allocation that would take the last of it risks the OOM killer for what is only a speed-up.
ROLLBACK_HEADROOM_BYTES = 1 << 30


def rollback_budget(free_bytes: int, to_come_bytes: int = 0, first_batch_bytes: int = 0) -> int:
    """Host bytes the rollback copies may take: `free_bytes` (what the host has free when they are sized) less what
    the run still takes before the copies are filled (`to_come_bytes`: the gradient slabs' pages the first backward
    writes and the Adam state the first step creates, where they are not in `free_bytes` yet; `first_batch_bytes`:
    what the first batch allocates on the host, offloaded activations or graphs) and the headroom kept."""
    return free_bytes - to_come_bytes - first_batch_bytes - ROLLBACK_HEADROOM_BYTES


def layers_that_fit(layer_numels: Sequence[int], per_param: int, budget: int) -> int:
    """How many of the layers (their parameter counts, in the order they would be speculated) have a copy of
    `per_param` bytes per parameter (modes.py rollback_bytes_per_param) within `budget`, taken in that order until
    the next does not fit."""
    need, count = 0, 0
    for numel in layer_numels:
        if need + per_param * numel > budget:
            break
        need += per_param * numel
        count += 1
    return count
