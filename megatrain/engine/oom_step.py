"""A device out-of-memory error in a step's update: residency lowered once (runtime/oom.py), the update redone for
what it had not done, nothing applied twice or half.

The host layers are queued before the parts updated on the caller's thread (the resident parameters, the
device-resident layers: update.py `Layered._queue`), which run one after the other, so the parts before the one that
failed are done and those after it untouched. Which one failed is read off torch's per-optimizer step hooks and its
Adam step counters (tensor version counters do not move under the engine's own writes): one whose step had begun
without counting is put back (state it made emptied) and redone on the gradients it loaded (a folded clip already
applied); one whose step had counted may have written its moments and is refused (StillOutOfMemory: load the last
checkpoint). An error before any layer was queued (the finite check, the norm) redoes the whole update. Other update
paths (the whole step, the optimizer in backward) cannot be told apart part by part: the error lowers residency for
the next steps and is raised (runtime/oom.py lowered_on_oom).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from .runtime.oom import (
    StillOutOfMemory,
    again,
    layers_backward,
    log,
    lower_once,
    lowered,
    lowered_on_oom,
    plan_tokens,
    redone_once_on_oom,
    release,
    tokens_of,
)
from .update import fused
from .update import update as path

# Engine.forward / backward / step's handling, imported by the engine from here in one place.
__all__ = ["layers_backward", "lowered_on_oom", "redone_once_on_oom", "update_step"]


def _parts(update: Any) -> list[tuple[Any, Any, Callable[[list[float] | None], None]]]:
    """(optimizer view, group, its update given the clip coefficients, None: the clipping's own) of what a Layered
    path updates on the caller's thread after queueing the host layers, in its order (update.py `Layered._queue`):
    the resident parameters, then the device-resident layers; empty for a path that updates otherwise."""


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
    def _steps(view: Any) -> tuple[list, torch.Tensor | None]:
        """(the parameters with a step counter, their counters stacked: one copy per part, not one per parameter)."""
        if view is None:
            return [], None
        params = [p for p, st in view.state.items() if torch.is_tensor(st.get("step"))]
        return params, (torch.stack([view.state[p]["step"] for p in params]) if params else None)

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    def counted(self, k: int) -> bool:
        """Whether part k's Adam step counters moved since the step began (state it made counts from 0)."""
        v = self.views[k]
        if v is None:
            return False
        params, before = self.steps[k]
        if params and not torch.equal(torch.stack([v.state[p]["step"] for p in params]), before):
            return True
        # state it made counts from 0 (a read on the device: this error's path only)
        return any(p not in self.keys[k] and torch.is_tensor(st.get("step")) and float(st["step"]) != 0
                   for p, st in v.state.items())

    def put_back(self, k: int) -> None:
        """Part k's Adam state as before its update began: state it made emptied in place (the dict is the main
        optimizer's too, update/optim.py; torch's Adam fills an empty one anew, as on a first step)."""
        v = self.views[k]
        for p, st in v.state.items():
            if p not in self.keys[k]:
                st.clear()


def _scaled_in_place(group: Any) -> bool:
    """Whether loading `group`'s gradients applied the pending clip to its slab itself (an FP32 slab, which is its
    own work buffer), not to a work buffer made afresh from it (a bf16 slab widened): then not again."""
    grad, work = getattr(group, "grad", None), getattr(group, "grad_work", None)
    return grad is not None and work is not None and work.data_ptr() == grad.data_ptr()


def _todo(progress: _Progress, parts: list, fused: list[bool]) -> list[tuple[int, bool]] | str:
    """(part, whether its gradients were already clip-scaled) of the parts to redo, in order; or why the update
    cannot be redone. The parts run one after the other, so those before the last one finished are done: finished is
    torch's step returned (its post hook), or for a part the engine's fused host pass updates (fused.py, which counts
    the step at its end) its step counted. The part after it is the one that failed: where torch's step had begun
    (its pre hook: its gradients loaded, a folded clip applied: on an FP32 slab, in place) without counting, its
    state is put back and it is redone on those gradients; where it had counted, its moments may be written and it is refused. A fused pass
    allocates nothing on the device (update/fused.py eligible: a host group's), so the error did not come from one."""
    finished = [progress.finished[k] or (fused[k] and progress.counted(k)) for k in range(len(parts))]
    last = max((k for k, f in enumerate(finished) if f), default=-1)
    todo: list[tuple[int, bool]] = []
    failed = last + 1
    if failed < len(parts) and progress.begun[failed]:
        if progress.counted(failed):
            return "its Adam state counted the step, so its moments or weights may be written"
        progress.put_back(failed)
        todo.append((failed, _scaled_in_place(parts[failed][1])))
        failed += 1
    return todo + [(k, False) for k in range(failed, len(parts))]


def update_step(engine: Any, finite: Callable[[], bool]) -> bool:
    """Engine.step's update (`engine.update.step(finite, clipping)`), redone after a device out-of-memory error with
    residency lowered once and the kept weights the lowered plan gives up freed: the whole update where it failed
    before updating anything (the finite check, the norm), else the parts updated on the caller's thread that were
    not done when it failed (`_parts`; the host layers were queued before them). Raised where it cannot be redone."""
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
        if lowered(engine) is not None:
            raise again(engine, err, "step") from err
        if judged and not parts:
            raise  # a path whose update cannot be told apart part by part
        todo = _todo(progress, parts, by_pass) if judged else []
        if isinstance(todo, str):
            raise StillOutOfMemory(
                f"the device ran out of memory in the middle of an update ({todo}), which cannot be taken back; "
                f"load the last checkpoint. Set the megatrain setting residency to \"stream\" or a smaller "
                f"device_budget_bytes to leave the update room. The error: {err}") from err
        said = lower_once(engine, tokens_of(engine))
        if said is None:
            raise
    finally:
        progress.close()
    log.warning("megatrain: %s; redoing the step's update (%s)", said,
                "from its start" if not judged else f"{len(todo)} of its {len(parts)} device parts")
    _free_kept_weights(engine)
    release(engine.device)
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
        raise again(engine, err, "step") from err


def _free_kept_weights(engine: Any) -> None:
    """The kept weights the lowered budget no longer plans for, freed now (the next forward plans the same)."""
    pipeline = engine.pipeline
    if pipeline.policy is not None and pipeline.last_plan is not None:
        pipeline.plan_batch(tokens_of(engine) or plan_tokens(pipeline.last_plan), engine.config.offload_activations)
