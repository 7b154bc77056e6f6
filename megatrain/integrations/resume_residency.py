"""A Trainer run resumed from a checkpoint places the optimizer-resident layer count its run recorded.

"auto" sizes how many of the first layers update on the device from the free memory when the engine is built
(engine/update/resident.py); on a GPU those update with torch's AdamW and the rest with the host's kernel, so the
count decides the bits, and both faces' checkpoints record it (run/train_state.py residency_record). A script that
builds its engine itself passes `CheckpointResidency(record)`; on Hugging Face Trainer's road (and `megatrain train`,
which runs it) the engine is built inside `Trainer.train`, by accelerate's `deepspeed.initialize`, before the
checkpoint is read. So `Trainer.train(resume_from_checkpoint=...)` is wrapped here: the checkpoint's record is read
first (its meta only) and carried, while that call runs, on the model it trains (the one object Trainer hands
through accelerate to `deepspeed.initialize` and so to the backend): the engine the MegaTrain backend builds over it
gets the record's count through its placement advisor (backend/placement.py advice_for; the planner's advisor,
where it has one, still placing the per-batch kept weights and graphs, which change no bit). No module state is
swapped: two Trainer runs in one process each place their own checkpoint's count. The start line then says
"(from checkpoint)"; the faces' warning on a count that differs is not reached.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..run import checkpoint as ckpt
from ..run import train_state

_saved: dict[str, Any] = {}


def checkpoint_record(folder: str | Path) -> dict[str, Any] | None:
    """The residency record of a Trainer checkpoint folder: the DeepSpeed face's (its newest tag's meta, read alone)
    or the Accelerate face's file; None where it holds none (a run before records were, another backend's)."""
    folder = Path(folder)
    record = train_state.saved_residency(folder)
    if record is not None:
        return record
    tag = ckpt.latest_tag(folder) if folder.is_dir() else None
    meta = folder / tag / ckpt.META_FILE if tag is not None else None
    if meta is None or not meta.is_file():
        return None
    return train_state.saved_residency(json.loads(meta.read_text()))


@contextlib.contextmanager
def resuming(trainer: Any, record: dict[str, Any] | None) -> Iterator[None]:
    """While it is entered, the model `trainer` trains carries `record` (its `model`, and the one its `model_init`
    makes inside the call, as Trainer.train does with one): an engine the MegaTrain backend builds over it with
    residency "auto" places `record`'s optimizer-resident count (backend/placement.py advice_for)."""
    if record is None:
        yield
        return
    # the engine's stack only for a resume: this module loads at deepspeed's import
    from ..backend import placement

    marked: list[Any] = []

    def carry(model: Any) -> Any:
        if hasattr(model, "__dict__"):
            vars(model)[placement.RESUMED] = record
            marked.append(model)
        return model

    carry(getattr(trainer, "model", None))
    wrap = getattr(trainer, "model_init", None) is not None
    if wrap:  # Trainer.train makes its model anew from model_init: that one carries it
        before = vars(trainer).get("call_model_init")  # an instance's own (None: the class's method)
        made_by = trainer.call_model_init
        trainer.call_model_init = lambda *a, **k: carry(made_by(*a, **k))
    try:
        yield
    finally:
        for model in marked:
            vars(model).pop(placement.RESUMED, None)
        if wrap and before is None:
            del vars(trainer)["call_model_init"]
        elif wrap:
            trainer.call_model_init = before


def _resume_folder(trainer: Any, resume_from_checkpoint: Any) -> str | None:
    """The folder Trainer.train resumes from: as given, or True for the output folder's newest (Trainer's rule)."""
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    if resume_from_checkpoint is True:
        from transformers.trainer_utils import get_last_checkpoint

        return get_last_checkpoint(trainer.args.output_dir)
    return str(resume_from_checkpoint)


def install() -> None:
    """Wrap Trainer.train (once): a resume places the checkpoint's recorded residency."""
    if "train" in _saved:
        return
    from transformers import Trainer

    real = Trainer.train

    @functools.wraps(real)
    def train(self: Any, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        folder = _resume_folder(self, resume_from_checkpoint)
        with resuming(self, checkpoint_record(folder) if folder is not None else None):
            return real(self, resume_from_checkpoint, *args, **kwargs)

    _saved["train"] = real
    Trainer.train = train


def install_if_loaded() -> None:
    """`install()` where transformers' Trainer is imported already (a script imports it before it builds the
    TrainingArguments whose DeepSpeed config first imports deepspeed, which loads megatrain.integrations.hf): not
    importing it here, at deepspeed's import, for a process that never trains with it."""
    import sys

    if "transformers.trainer" in sys.modules:
        install()


def uninstall() -> None:
    real = _saved.pop("train", None)
    if real is not None:
        from transformers import Trainer

        Trainer.train = real
