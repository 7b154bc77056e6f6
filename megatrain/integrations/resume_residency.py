"""A Trainer run resumed from a checkpoint places the optimizer-resident layer count its run recorded.

"auto" sizes how many of the first layers update on the device from the free memory when the engine is built
(engine/update/resident.py); on a GPU those update with torch's AdamW and the rest with the host's kernel, so the
count decides the bits, and both faces' checkpoints record it (run/train_state.py residency_record). A script that
builds its engine itself passes `CheckpointResidency(record)`; on Hugging Face Trainer's road (and `megatrain train`,
which runs it) the engine is built inside `Trainer.train`, by accelerate's `deepspeed.initialize`, before the
checkpoint is read. So `Trainer.train(resume_from_checkpoint=...)` is wrapped here: the checkpoint's record is read
first (its meta only) and, while that call runs, an engine the MegaTrain backend builds gets the record's count
through its placement advisor (the planner's, where it has one, still placing the per-batch kept weights and
graphs, which change no bit). The start line then says "(from checkpoint)"; the faces' warning on a count that
differs is not reached.
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
def resuming(record: dict[str, Any] | None) -> Iterator[None]:
    """While it is entered, an engine the MegaTrain backend builds with residency "auto" places `record`'s
    optimizer-resident count (train_state.CheckpointResidency around the advisor it would have had)."""
    if record is None:
        yield
        return
    from .. import backend

    planner = backend.placement_advice

    def advice(device: Any, model: Any, config: Any, device_name: str | None = None) -> Any:
        inner = planner(device, model, config, device_name)
        if config.residency_set is not None:
            return inner  # counts the user set: theirs
        return train_state.CheckpointResidency(record, inner)

    backend.placement_advice = advice
    try:
        yield
    finally:
        backend.placement_advice = planner


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
        with resuming(checkpoint_record(folder) if folder is not None else None):
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
