"""A device out-of-memory error in a forward lowers residency once, says so, and redoes the forward.

The device budget is read once, when the engine is built (free memory then); another process that takes memory
later, the allocator's fragmentation or an estimate short of a model's real working set can leave a batch's plan
(its kept weights and graphs beside the working set, costs/memory.py) larger than the device. Residency is the part
of the plan that is optional: streaming a layer instead of keeping it computes the same bits (costs/residency.py),
only slower. So the first out-of-memory error of a training or eval forward lowers the budget the plans are made
in so that they peak half of what the failed plan kept (its kept weights and the graphs it held on the device)
below the peak that failed, logs what it gave up, and runs the forward again from its start, in the same bits. Once per engine: a second error is raised as it
is, as is one where nothing was kept to give up, or where the placement is the user's own counts (residency set),
or "auto" had no budget to lower.

A forward is redone whole: it changes nothing the next call reads before it returns (the loss, the pending
backward are set at its end). A backward or a step is not: gradients already added into the slabs, or a device
update half done, cannot be taken back, so an error there still ends the step (its residency is lowered for the
next ones all the same).
"""

from __future__ import annotations

import functools
import gc
import logging
import math
from collections.abc import Callable
from typing import Any
from weakref import WeakKeyDictionary

import torch

from ...costs.memory import BUDGET_HEADROOM, layer_graph_bytes
from ...costs.residency import Residency

log = logging.getLogger("megatrain")
# Engines whose residency an out-of-memory error has lowered (once each), and each one's last forward's tokens.
_LOWERED: WeakKeyDictionary = WeakKeyDictionary()
_TOKENS: WeakKeyDictionary = WeakKeyDictionary()


def kept_bytes(policy: Any, plan: Any, tokens: int) -> int:
    """Device bytes `plan`'s residency kept beyond the working set: its kept weights (the ring freed when every layer
    is kept) and the graphs it held on the device."""
    r = plan.residency
    weights = r.weights * policy.dims.numel * policy.itemsize - (policy.ring_bytes if r.weights == policy.n_layers
                                                                 else 0)
    return max(0, weights) + r.device_graphs * layer_graph_bytes(policy.dims, tokens, policy.itemsize)


def lower_residency(pipeline: Any, tokens: int) -> str | None:
    """Lower the budget `pipeline`'s plans are made in, so that they peak half of what its last plan kept below that
    plan's predicted peak (the optimizer-resident layers' state excepted: it lives there for the run): the next plan
    keeps less. What was done, or None where there is nothing to lower (no plan, no budget, counts the user set,
    nothing kept)."""
    policy, plan = getattr(pipeline, "policy", None), getattr(pipeline, "last_plan", None)
    if policy is None or plan is None or policy.budget is None or isinstance(policy.residency, Residency):
        return None
    kept = kept_bytes(policy, plan, tokens)
    if kept <= 0:
        return None
    # The device could not hold the plan's predicted peak (the budget above it had room the plan never used): the
    # next plans are made to peak at half the kept bytes below it.
    before = policy.budget
    policy.budget = min(before, max(0, math.floor((plan.predicted_peak_bytes - kept / 2) / BUDGET_HEADROOM)))
    return (f"the device ran out of memory with {plan.residency.weights} layers' weights and "
            f"{plan.residency.device_graphs} layers' graphs kept; residency lowered once: the device budget "
            f"{before / 2**20:.1f} -> {policy.budget / 2**20:.1f} MiB (plans peak {kept / 2 / 2**20:.1f} MiB, half "
            f"of what was kept, below the {plan.predicted_peak_bytes / 2**20:.1f} MiB that failed), the same "
            f"bits, slower")


def _release(device: torch.device) -> None:
    """What the failed attempt held, back to the device before the retry allocates."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _tokens(args: tuple, kwargs: dict) -> int:
    ids = kwargs.get("input_ids", args[0] if args else None)
    return int(ids.numel()) if torch.is_tensor(ids) else 0


def redone_once_on_oom(method: Callable) -> Callable:
    """Engine.forward run again after its first device out-of-memory error, with residency lowered
    (`lower_residency`); the error raised as it is where that cannot be done."""

    @functools.wraps(method)
    def run(engine: Any, *args: Any, **kwargs: Any) -> Any:
        _TOKENS[engine] = tokens = _tokens(args, kwargs)
        try:
            return method(engine, *args, **kwargs)
        except torch.OutOfMemoryError:
            if engine in _LOWERED:
                raise
            said = lower_residency(engine.pipeline, tokens)
            if said is None:
                raise
            _LOWERED[engine] = said
        log.warning("megatrain: %s; redoing the forward", said)
        _release(engine.device)
        return method(engine, *args, **kwargs)

    return run


def lowered(engine: Any) -> str | None:
    """What an out-of-memory error made `engine` give up (for its stats and the run's report), None if nothing."""
    return _LOWERED.get(engine)


def lowered_on_oom(method: Callable) -> Callable:
    """Engine.backward / Engine.step: a device out-of-memory error there lowers residency for the next steps (once
    per engine, said on the log) and is raised: gradients partly added, or an update half done, cannot be redone."""

    @functools.wraps(method)
    def run(engine: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(engine, *args, **kwargs)
        except torch.OutOfMemoryError:
            if engine not in _LOWERED:
                said = lower_residency(engine.pipeline, _TOKENS.get(engine, 0))
                if said is not None:
                    _LOWERED[engine] = said
                    log.warning("megatrain: %s; this step cannot be redone (its gradients were partly added): "
                                "zero_grad() and run it again", said)
            raise

    return run
