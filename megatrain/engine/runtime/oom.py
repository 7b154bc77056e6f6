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
added twice. A step's update (`update_step`) is redone for what had not been updated when it failed: the host layers
are queued before the parts updated on the caller's thread (the resident parameters, the device-resident layers),
which run one after the other; the one that failed is checked by its tensors' version counters (its step counter
put back, Adam state it created dropped) and a part that half wrote its master, Adam state or gradient is refused
rather than applied twice. The second error of an engine raises `StillOutOfMemory`, which says what to set.
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


def _again(engine: Any, err: BaseException, where: str) -> StillOutOfMemory:
    redo = ("; the gradients this step added so far are partial: call zero_grad() and run the step again"
            if where != "forward" else "")
    return StillOutOfMemory(
        f"the device ran out of memory in a {where} again after residency was lowered once ({_LOWERED[engine]}): "
        f"set the megatrain setting residency to \"stream\" (the DeepSpeed config's \"megatrain\" section, "
        f"Accelerator(megatrain={{...}}) or `--set residency=stream`), or a smaller device_budget_bytes, or train "
        f"shorter sequences or smaller micro-batches{redo}. The error: {err}")


def _lower_once(engine: Any, tokens: int) -> str | None:
    """Residency lowered for `engine` if it never was (said on the log by the caller); None where it cannot be."""
    if engine in _LOWERED:
        return None
    said = lower_residency(engine.pipeline, tokens)
    if said is not None:
        _LOWERED[engine] = said
    return said


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
                raise _again(engine, err, "forward") from err
            said = _lower_once(engine, tokens)
            if said is None:
                raise
        log.warning("megatrain: %s; redoing the forward", said)
        _release(engine.device)
        try:
            return method(engine, *args, **kwargs)
        except torch.OutOfMemoryError as err:
            raise _again(engine, err, "forward") from err

    return run


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
                raise _again(engine, err, method.__name__) from err
            said = _lower_once(engine, _TOKENS.get(engine, 0))
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
            raise _again(engine, err, "backward") from err
        # A router's logits gradients are handed to each layer's backward once (templates.py): a mixture of experts
        # cannot go on from a layer whose backward took them.
        if engine.templates.routed or not pipeline.resumable(acts):
            raise
        top, g_top = pipeline.resume
        said = _lower_once(engine, _TOKENS.get(engine, 0))
        if said is None:
            raise
    given_up = pipeline.recompute_kept(acts, top)
    log.warning("megatrain: %s; the backward goes on from layer %d (the layers above it added their gradients once; "
                "%d kept graphs given up for a recompute)", said, top, given_up)
    _release(engine.device)
    try:
        return pipeline.backward(g_top, pending.layer_inputs, acts, sent, side=pending.side, floor=floor, ceiling=top)
    except torch.OutOfMemoryError as err:
        raise _again(engine, err, "backward") from err


# -- the step's update ----------------------------------------------------------------------------------------------


def _parts(update: Any) -> list[tuple[Any, Any, Callable[[list[float] | None], None]]]:
    """(optimizer view, group, its update given the clip coefficients, None: the clipping's own) of what a Layered
    path updates on the caller's thread after queueing the host layers, in its order (update.py `Layered._queue`):
    the resident parameters, then the device-resident layers; empty for a path that updates otherwise."""
    from ..update import update as path  # the update path's own functions, looked up at call time

    layered = getattr(update, "layered", None)
    if not isinstance(update, path.Layered) or layered is None:
        return []
    store, threads, spill = update.store, update.threads, update.spill
    parts = []
    view = layered.view_globals()
    if view is not None:
        parts.append((view, store.globals, lambda coefs: path.update_group(view, store.globals, coefs, threads)))
    for i in sorted(update.device_layers):

        def one(coefs: list[float], i: int = i) -> None:
            update.events.landed[i].host_wait(update.config.watchdog_s)
            run = functools.partial(path.update_layer, layered, store.layers[i], i, coefs, threads)
            run() if spill is None else spill.around(i, run)

        parts.append((layered.view_optimizer(i), store.layers[i], one))
    return parts


class _Progress:
    """How far each part's update got, from its optimizer view's step hooks (torch's, per optimizer) and its Adam
    step counters (torch's AdamW counts before it writes anything): begun, finished, counted."""

    def __init__(self, parts: list) -> None:
        self.views = [view for view, _, _ in parts]
        self.begun = [False] * len(parts)
        self.finished = [False] * len(parts)
        self.steps = [self._steps(v) for v in self.views]
        self.keys = [{p: set(st) for p, st in v.state.items()} if v is not None else {} for v in self.views]
        self.handles = []
        for k, v in enumerate(self.views):
            if v is not None:
                self.handles.append(v.register_step_pre_hook(lambda *a, k=k: self.begun.__setitem__(k, True)))
                self.handles.append(v.register_step_post_hook(lambda *a, k=k: self.finished.__setitem__(k, True)))

    @staticmethod
    def _steps(view: Any) -> dict:
        if view is None:
            return {}
        return {p: st["step"].clone() for p, st in view.state.items() if torch.is_tensor(st.get("step"))}

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    def counted(self, k: int) -> bool:
        """Whether part k's Adam step counters moved since the step began (state it made counts from 0)."""
        v = self.views[k]
        if v is None:
            return False
        for p, st in v.state.items():
            step = st.get("step")
            if not torch.is_tensor(step):
                continue
            if p in self.steps[k] and not torch.equal(step, self.steps[k][p]):
                return True
            if p not in self.keys[k] and float(step) != 0:  # (a read on the device: this error's path only)
                return True
        return False

    def put_back(self, k: int) -> None:
        """Part k's Adam state as before its update began: state it made emptied in place (the dict is the main
        optimizer's too, update/optim.py; torch's Adam fills an empty one anew, as on a first step)."""
        v = self.views[k]
        for p, st in v.state.items():
            if p not in self.keys[k]:
                st.clear()


def _todo(progress: _Progress, parts: list, fused: list[bool]) -> list[tuple[int, bool]] | str:
    """(part, whether its gradients were already clip-scaled) of the parts to redo, in order; or why the update
    cannot be redone. The parts run one after the other, so those before the last one finished are done: finished is
    torch's step returned (its post hook), or for a part the engine's fused host pass updates (fused.py, which counts
    the step at its end) its step counted. The part after it is the one that failed: where torch's step had begun
    (its pre hook: its gradients loaded, a folded clip applied) without counting, its state is put back and it is
    redone on those gradients; where it had counted, its moments may be written and it is refused. A fused pass
    allocates nothing on the device (update/fused.py eligible: a host group's), so the error did not come from one."""
    finished = [progress.finished[k] or (fused[k] and progress.counted(k)) for k in range(len(parts))]
    last = max((k for k, f in enumerate(finished) if f), default=-1)
    todo: list[tuple[int, bool]] = []
    failed = last + 1
    if failed < len(parts) and progress.begun[failed]:
        if progress.counted(failed):
            return "its Adam state counted the step, so its moments or weights may be written"
        progress.put_back(failed)
        todo.append((failed, True))
        failed += 1
    if last >= 0:
        parts[last][1].pack()  # its streamed copy written again from its master (the error may have come there)
    return todo + [(k, False) for k in range(failed, len(parts))]


def update_step(engine: Any, finite: Callable[[], bool]) -> bool:
    """Engine.step's update (`engine.update.step(finite, clipping)`), redone after a device out-of-memory error with
    residency lowered once and the kept weights the lowered plan gives up freed: the whole update where it failed
    before updating anything (the finite check, the norm), else the parts updated on the caller's thread that were
    not done when it failed (`_parts`; the host layers were queued before them). Raised where it cannot be redone."""
    from ..update import fused

    update, clip = engine.update, engine.clipping
    parts = _parts(update)
    progress = _Progress(parts)
    by_pass = [v is not None and fused.eligible(v, g) for v, g, _ in parts]  # as the update is about to decide
    judged: list[bool] = []

    def checked() -> bool:
        judged.append(finite())
        return judged[-1]

    try:
        return update.step(checked, clip)
    except torch.OutOfMemoryError as err:
        if isinstance(err, StillOutOfMemory):
            raise
        if engine in _LOWERED:
            raise _again(engine, err, "step") from err
        if judged and not parts:
            raise  # a path whose update cannot be told apart part by part
        todo = _todo(progress, parts, by_pass) if judged else []
        if isinstance(todo, str):
            raise StillOutOfMemory(
                f"the device ran out of memory in the middle of an update ({todo}), which cannot be taken back; "
                f"load the last checkpoint. Set the megatrain setting residency to \"stream\" or a smaller "
                f"device_budget_bytes to leave the update room. The error: {err}") from err
        said = _lower_once(engine, _TOKENS.get(engine, 0))
        if said is None:
            raise
    finally:
        progress.close()
    log.warning("megatrain: %s; redoing the step's update (%s)", said,
                "from its start" if not judged else f"{len(todo)} of its {len(parts)} device parts")
    _free_kept_weights(engine)
    _release(engine.device)
    try:
        if not judged:
            return update.step(finite, clip)
        for k, scaled in todo:
            parts[k][2]([] if scaled else (clip.resident_coefs() if k == 0 and parts[0][1] is update.store.globals
                                           else clip.layer_coefs()))
        if not update.overlapped:
            update.layered.synchronize()
        update.layered.optimizer._opt_called = True  # LR schedulers check that optimizer.step() ran before them
        return True
    except torch.OutOfMemoryError as err:
        raise _again(engine, err, "step") from err


def _free_kept_weights(engine: Any) -> None:
    """The kept weights the lowered budget no longer plans for, freed now (the next forward plans the same)."""
    pipeline = engine.pipeline
    if pipeline.policy is not None and pipeline.last_plan is not None:
        pipeline.plan_batch(_TOKENS.get(engine, 0) or plan_tokens(pipeline.last_plan), engine.config.offload_activations)
