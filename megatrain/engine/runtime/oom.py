"""A device out-of-memory error in a forward, a backward or a step lowers residency once, says so, and redoes it.

The device budget is read once, when the engine is built (free memory then); another process that takes memory
later, the allocator's fragmentation or an estimate short of a model's real working set can leave a batch's plan
(its kept weights and graphs beside the working set, costs/memory.py) larger than the device. Residency is the part
of the plan that is optional: streaming a layer instead of keeping it computes the same bits (costs/residency.py),
only slower. So the first out-of-memory error of a training or eval forward lowers the budget the plans are made
in so that they peak half of what the failed plan kept (its kept weights and the graphs it held on the device)
below the peak that failed, logs what it gave up, and runs the forward again from its start, in the same bits. Once per engine: a second error raises `StillOutOfMemory`;
one where nothing was kept to give up, or where the placement is the user's own counts (residency set), or "auto"
had no budget to lower, is raised as it is.

A forward is redone whole: it changes nothing the next call reads before it returns (the loss, the pending
backward are set at its end). A backward goes on from where the error cut it short (`layers_backward`): each layer's
gradients are sent once, last layer first, so the layers above the one that failed have added theirs already (the
same bits a recompute gives), and the rest run with the kept graphs given up (recomputed from their inputs), nothing
added twice. A step's update is redone for what it had not updated (engine/oom_step.py, above this wing: it reads
the update path). The second error of an engine raises `StillOutOfMemory`, which says what to set.
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
    keeps less. What was done (the kept layers before and after), or None where there is nothing to lower (no plan,
    no budget, counts the user set, nothing kept)."""
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
    old = plan.residency
    new = policy.plan(tokens or plan_tokens(plan), True).residency  # what the next training batch keeps (they only shrink)
    return (f"the device ran out of memory with {old.weights} layers' weights and {old.device_graphs} layers' graphs "
            f"kept; residency lowered once: {old.weights} -> {new.weights} resident layers ({old.device_graphs} -> "
            f"{new.device_graphs} kept graphs), the device budget {before / 2**20:.1f} -> "
            f"{policy.budget / 2**20:.1f} MiB (plans peak {kept / 2 / 2**20:.1f} MiB, half of what was kept, below "
            f"the {plan.predicted_peak_bytes / 2**20:.1f} MiB that failed), the same bits, slower")


def plan_tokens(plan: Any) -> int:
    """The tokens a plan was made for, where it records them (else 1: a placement's counts do not depend on it)."""
    return int(getattr(plan, "tokens", 0) or 1)


class StillOutOfMemory(torch.OutOfMemoryError):
    """The device ran out of memory again after an engine had lowered its residency once: what to set says it."""


def again(engine: Any, err: BaseException, where: str) -> StillOutOfMemory:
    """The error a second out-of-memory error of `engine` (in a `where`) raises: what to set."""
    redo = ("; the gradients this step added so far are partial: call zero_grad() and run the step again"
            if where != "forward" else "")
    return StillOutOfMemory(
        f"the device ran out of memory in a {where} again after residency was lowered once ({_LOWERED[engine]}): "
        f"set the megatrain setting residency to \"stream\" (the DeepSpeed config's \"megatrain\" section, "
        f"Accelerator(megatrain={{...}}) or `--set residency=stream`), or a smaller device_budget_bytes, or train "
        f"shorter sequences or smaller micro-batches{redo}. The error: {err}")


def lower_once(engine: Any, tokens: int) -> str | None:
    """Residency lowered for `engine` if it never was (said on the log by the caller); None where it cannot be."""
    if engine in _LOWERED:
        return None
    said = lower_residency(engine.pipeline, tokens)
    if said is not None:
        _LOWERED[engine] = said
    return said


def release(device: torch.device) -> None:
    """What the failed attempt held, back to the device before the retry allocates."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _tokens(args: tuple, kwargs: dict) -> int:
    ids = kwargs.get("input_ids", args[0] if args else None)
    return int(ids.numel()) if torch.is_tensor(ids) else 0


def redone_once_on_oom(method: Callable) -> Callable:
    """Engine.forward run again after its first device out-of-memory error, with residency lowered
    (`lower_residency`); the error raised as it is where that cannot be done, `StillOutOfMemory` after the lowering."""

    @functools.wraps(method)
    def run(engine: Any, *args: Any, **kwargs: Any) -> Any:
        _TOKENS[engine] = tokens = _tokens(args, kwargs)
        try:
            return method(engine, *args, **kwargs)
        except torch.OutOfMemoryError as err:
            if isinstance(err, StillOutOfMemory):
                raise
            if engine in _LOWERED:
                raise again(engine, err, "forward") from err
            said = lower_once(engine, tokens)
            if said is None:
                raise
        log.warning("megatrain: %s; redoing the forward", said)
        release(engine.device)
        try:
            return method(engine, *args, **kwargs)
        except torch.OutOfMemoryError as err:
            raise again(engine, err, "forward") from err

    return run


def tokens_of(engine: Any) -> int:
    """The tokens of `engine`'s last forward (0 before any)."""
    return _TOKENS.get(engine, 0)


def lowered(engine: Any) -> str | None:
    """What an out-of-memory error made `engine` give up (for its stats and the run's report), None if nothing."""
    return _LOWERED.get(engine)


def lowered_on_oom(method: Callable) -> Callable:
    """Engine.backward / Engine.step: a device out-of-memory error where neither can go on (the head's or the
    embedding's backward, a clip; `layers_backward` and `update_step` go on from theirs) lowers residency for the
    next steps (once per engine, said on the log) and is raised."""

    @functools.wraps(method)
    def run(engine: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(engine, *args, **kwargs)
        except torch.OutOfMemoryError as err:
            if isinstance(err, StillOutOfMemory):
                raise
            if engine in _LOWERED:
                raise again(engine, err, method.__name__) from err
            said = lower_once(engine, _TOKENS.get(engine, 0))
            if said is not None:
                log.warning("megatrain: %s; this %s cannot be redone (it failed where its gradients may be partly "
                            "added): zero_grad() and run the step again", said, method.__name__)
            raise

    return run


def layers_backward(engine: Any, g: torch.Tensor, pending: Any, sent: Callable[[int], None] | None,
                    floor: int) -> torch.Tensor | None:
    """The layers' part of Engine.backward (LayerPipeline.backward from `g`, the gradient of the last layer's
    output), gone on with after a device out-of-memory error: residency lowered once, the layers above the one it
    cut short left as sent (their gradients added once), the kept graphs below given up for recomputes (their
    device memory freed), and the backward run on from that layer's output gradient."""
    pipeline, acts = engine.pipeline, pending.acts
    try:
        return pipeline.backward(g, pending.layer_inputs, acts, sent, side=pending.side, floor=floor)
    except torch.OutOfMemoryError as err:
        if isinstance(err, StillOutOfMemory):
            raise
        if engine in _LOWERED:
            raise again(engine, err, "backward") from err
        # A router's logits gradients are handed to each layer's backward once (templates.py): a mixture of experts
        # cannot go on from a layer whose backward took them.
        if engine.templates.routed or not pipeline.resumable(acts):
            raise
        top, g_top = pipeline.resume
        said = lower_once(engine, _TOKENS.get(engine, 0))
        if said is None:
            raise
    given_up = pipeline.recompute_kept(acts, top)
    log.warning("megatrain: %s; the backward goes on from layer %d (the layers above it added their gradients once; "
                "%d kept graphs given up for a recompute)", said, top, given_up)
    release(engine.device)
    try:
        return pipeline.backward(g_top, pending.layer_inputs, acts, sent, side=pending.side, floor=floor, ceiling=top)
    except torch.OutOfMemoryError as err:
        raise again(engine, err, "backward") from err
