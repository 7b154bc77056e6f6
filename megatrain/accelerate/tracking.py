"""Experiment trackers for the Accelerate face: accelerate's own tracker classes, one process.

`log_with` takes what accelerate's does: a tracker name ("tensorboard", "wandb", ...), "all" (every
installed one), an `accelerate.tracking.GeneralTracker` instance, or a list of these.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["make_trackers"]


def _requested(log_with: Any) -> list[Any]:
    if log_with is None:
        return []
    return list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]


def make_trackers(log_with: Any, project_name: str, logging_dir: str | os.PathLike | None,
                  config: dict[str, Any] | None, init_kwargs: dict[str, dict[str, Any]] | None) -> list[Any]:
    """Start the requested trackers, storing `config` as their hyper-parameters."""
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, GeneralTracker, get_available_trackers

    init_kwargs = init_kwargs or {}
    available = [str(t) for t in get_available_trackers()]
    wanted: list[Any] = []
    for item in _requested(log_with):
        if isinstance(item, GeneralTracker):
            wanted.append(item)
        elif str(item) == "all":
            wanted += available
        elif str(item) in LOGGER_TYPE_TO_CLASS:
            if str(item) not in available:
                raise ValueError(f"log_with={str(item)!r}: that tracker's package is not installed (installed: "
                                 f"{available or 'none'})")
            wanted.append(str(item))
        else:
            raise ValueError(f"log_with={item!r} is not a tracker: use one of {sorted(LOGGER_TYPE_TO_CLASS)}, 'all' "
                             "or an accelerate.tracking.GeneralTracker instance")
    trackers = []
    for item in wanted:
        if isinstance(item, GeneralTracker):
            tracker = item
        else:
            cls = LOGGER_TYPE_TO_CLASS[item]
            kwargs = dict(init_kwargs.get(item, {}))
            if getattr(cls, "requires_logging_directory", False):
                if logging_dir is None:
                    raise ValueError(f"tracker {item!r} needs a logging directory: pass project_dir= or "
                                     "ProjectConfiguration(logging_dir=...)")
                tracker = cls(project_name, logging_dir, **kwargs)
            else:
                tracker = cls(project_name, **kwargs)
        if hasattr(tracker, "start"):
            tracker.start()
        if config is not None:
            tracker.store_init_configuration(config)
        trackers.append(tracker)
    return trackers
