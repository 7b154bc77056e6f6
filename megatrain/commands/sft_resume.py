"""`megatrain train --config` never loses a run: what its output folder holds, and when checkpoints are written.

Trainer writes `checkpoint-<step>` folders; a kill in the middle of one leaves it half written, so the callback
here marks a folder whole (WHOLE_MARK) only once Trainer has finished it, and a run resumes from the newest
marked one. The output folder also records the settings the run trains with (RUN_FILE): the same command again
resumes; a changed setting, or a folder whose checkpoints cannot be resumed, is refused unless `--restart`.

Checkpoints are written every `save_minutes` of training (and every `save_steps` steps if set), and when SIGINT
or SIGTERM arrives: the step in flight finishes, a checkpoint is written, and the run stops
(`megatrain.run.graceful.GracefulStop`, so a second signal stops at once).
"""

from __future__ import annotations

import json
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["RUN_FILE", "WHOLE_MARK", "FINAL_DIR", "OutputState", "RefusedOutput", "inspect_output", "prepare_output",
           "record_run", "mark_finished", "SaveCallback"]

RUN_FILE = "megatrain_run.json"
WHOLE_MARK = "megatrain_whole"  # in a checkpoint folder: Trainer finished writing it
FINAL_DIR = "final"
# Settings that may differ between a run and its resumption: they change what is written, not what is trained.
RESUMABLE_CHANGES = frozenset({"report", "save_steps", "save_minutes", "save_total_limit", "logging_steps"})
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


class RefusedOutput(ValueError):
    """The output folder holds something this run must not overwrite or cannot resume."""


@dataclass
class OutputState:
    checkpoints: list[tuple[int, Path, bool]]  # (step, folder, whole), oldest first
    recorded: dict[str, Any] | None  # RUN_FILE's settings, if written
    finished: bool

    @property
    def newest_whole(self) -> tuple[int, Path] | None:
        whole = [(step, p) for step, p, ok in self.checkpoints if ok]
        return whole[-1] if whole else None


def inspect_output(output_dir: str | Path) -> OutputState:
    """What `output_dir` holds of an earlier run (nothing when it does not exist)."""
    out = Path(output_dir)
    ckpts = []
    if out.is_dir():
        for p in out.iterdir():
            m = _CHECKPOINT.match(p.name)
            if m and p.is_dir():
                ckpts.append((int(m.group(1)), p, (p / WHOLE_MARK).is_file()))
    ckpts.sort()
    recorded, finished = None, False
    if (out / RUN_FILE).is_file():
        try:
            saved = json.loads((out / RUN_FILE).read_text())
            recorded, finished = saved.get("settings"), bool(saved.get("finished"))
        except (OSError, ValueError, AttributeError):
            recorded = None
    return OutputState(ckpts, recorded, finished)


# Engine settings (the "megatrain" section) that may differ too: they change how the step is scheduled, traced or
# copied, never a value it computes (docs/SETTINGS.md says why for each).
RESUMABLE_ENGINE_CHANGES = frozenset({"num_buffers", "residency", "trace", "pin_memory", "measure_device_memory",
                                      "watchdog_s", "link_gbps", "nvme_gbps", "host_mmap_threshold_bytes"})


def _changes(recorded: dict[str, Any], settings: dict[str, Any]) -> list[str]:
    keys = sorted((recorded.keys() | settings.keys()) - RESUMABLE_CHANGES)
    out = []
    for k in keys:
        was, now = recorded.get(k), settings.get(k)
        if k == "megatrain" and isinstance(was or {}, dict) and isinstance(now or {}, dict):
            was, now = dict(was or {}), dict(now or {})
            out += [f"megatrain.{e}: {was.get(e)!r} -> {now.get(e)!r}" for e in sorted(was.keys() | now.keys())
                    if e not in RESUMABLE_ENGINE_CHANGES and was.get(e) != now.get(e)]
        elif was != now:
            out.append(f"{k}: {was!r} -> {now!r}")
    return out


def prepare_output(output_dir: str | Path, settings: dict[str, Any], restart: bool) -> tuple[Path | None, str]:
    """(the checkpoint to resume from or None, what to tell the user); the folder made ready for the run.

    Refuses (RefusedOutput) a folder with checkpoints of other settings, or with none whole, unless `restart`;
    with `restart` removes this command's own earlier output (checkpoints, final/, the run record), nothing else.
    Nothing is written or removed before every check has passed.
    """
    out = Path(output_dir)
    state = inspect_output(out)
    again = "run with --restart to start over there (its checkpoints are deleted), or give another output_dir"
    if restart:
        removed = [p for _, p, _ in state.checkpoints] + [p for p in (out / FINAL_DIR,) if p.is_dir()]
        for p in removed:
            shutil.rmtree(p)
        (out / RUN_FILE).unlink(missing_ok=True)
        if not removed:
            return None, ""
        return None, f"--restart: starting over in {out} (removed {len(removed)} folder(s) of the earlier run)"
    if not state.checkpoints and not state.finished:
        # an earlier run stopped before its first checkpoint: nothing to resume or to lose
        return None, "" if state.recorded is None else f"no checkpoint of the earlier run in {out}: starting at step 1"
    if state.recorded is not None:
        changed = _changes(state.recorded, settings)
        if changed:
            raise RefusedOutput(f"output_dir {out} holds a run with other settings ({'; '.join(changed)}); "
                                f"resuming it would train something else: {again}")
    elif state.checkpoints:
        raise RefusedOutput(f"output_dir {out} holds checkpoints of a run without its settings ({RUN_FILE}): {again}")
    if state.finished:
        raise RefusedOutput(f"output_dir {out} holds this run, finished ({out / FINAL_DIR}): "
                            f"nothing to resume; {again}")
    newest = state.newest_whole
    if newest is None:
        raise RefusedOutput(f"output_dir {out} holds only half-written checkpoints "
                            f"({', '.join(p.name for _, p, _ in state.checkpoints)}): {again}")
    step, folder = newest
    # a folder a kill cut short after the newest whole one would be overwritten step by step: remove it first
    for s, p, ok in state.checkpoints:
        if s > step and not ok:
            shutil.rmtree(p)
    return folder, f"resuming from {folder} (step {step}; --restart starts over)"


def record_run(output_dir: str | Path, settings: dict[str, Any]) -> None:
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / RUN_FILE).write_text(json.dumps({"settings": settings, "finished": False}, indent=1))


def mark_finished(output_dir: str | Path, settings: dict[str, Any]) -> None:
    (Path(output_dir) / RUN_FILE).write_text(json.dumps({"settings": settings, "finished": True}, indent=1))


def _trainer_callback() -> type:
    from transformers import TrainerCallback

    return TrainerCallback


class SaveCallback(_trainer_callback()):  # type: ignore[misc]
    """Trainer callback: a checkpoint every `save_minutes` (0: never by time) and on a stop signal, which also ends
    training; every checkpoint Trainer finishes is marked whole. `stop` is a `GracefulStop` (or anything with a
    `requested` flag)."""

    def __init__(self, stop: Any, save_minutes: float, save_steps: int) -> None:
        self.stop = stop
        self.save_seconds = save_minutes * 60.0
        self.save_steps = save_steps
        self.last_save = time.monotonic()
        self.stopped_at: int | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.last_save = time.monotonic()

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        # Trainer calls this after an optimizer step, where a checkpoint holds everything needed to go on exactly.
        if self.stop.requested:
            control.should_save = True
            control.should_training_stop = True
            self.stopped_at = state.global_step
        elif self.save_seconds > 0 and time.monotonic() - self.last_save >= self.save_seconds:
            control.should_save = True
        elif state.global_step >= state.max_steps and not (self.save_steps and state.global_step % self.save_steps == 0):
            # Trainer would save a last checkpoint at the end; final/ holds the weights, the optimizer state is
            # not worth its size once the run is over
            control.should_save = False

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if folder.is_dir():
            (folder / WHOLE_MARK).write_text(json.dumps({"step": state.global_step}))
        self.last_save = time.monotonic()
