"""Where the Accelerate face puts checkpoints: accelerate's `ProjectConfiguration` rules, one process.

With `automatic_checkpoint_naming`, `save_state()` writes `<project_dir>/checkpoints/checkpoint_<iteration>`,
first deleting the oldest folders so that at most `total_limit` remain, and `load_state()` with no folder
reads the newest one, exactly as accelerate does.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

__all__ = ["make_project_config", "state_dir", "save_dir", "latest_dir"]


def make_project_config(project_dir: str | os.PathLike | None, project_config: Any) -> Any:
    from accelerate.utils import ProjectConfiguration

    if project_config is None:
        project_config = ProjectConfiguration()
    elif not isinstance(project_config, ProjectConfiguration):
        raise TypeError(f"project_config must be an accelerate.utils.ProjectConfiguration, got "
                        f"{type(project_config).__name__}")
    if project_dir is not None:
        if project_config.project_dir is not None and str(project_config.project_dir) != str(project_dir):
            raise ValueError(f"project_dir={str(project_dir)!r} contradicts project_config.project_dir="
                             f"{project_config.project_dir!r}; give one of them")
        project_config.set_directories(str(project_dir))
    return project_config


def _number(folder: str) -> int:
    # accelerate sorts checkpoint folders by the last number in their name
    found = re.findall(r"[\/]?([0-9]+)(?=[^\/]*$)", folder)
    if not found:
        raise ValueError(f"{folder} in the checkpoints folder has no iteration number; move it out of the way")
    return int(found[0])


def _checkpoints_root(project_config: Any) -> Path:
    if project_config.project_dir is None:
        raise ValueError("automatic_checkpoint_naming needs a project directory: pass project_dir= to the Accelerator "
                         "or ProjectConfiguration(project_dir=...)")
    return Path(project_config.project_dir) / "checkpoints"


def state_dir(output_dir: str | os.PathLike | None, project_config: Any) -> Path:
    """The folder `save_state(output_dir)` writes, named without touching the disk (every rank can ask)."""
    if not project_config.automatic_checkpoint_naming:
        if output_dir is None:
            raise ValueError("save_state() needs an output_dir (or ProjectConfiguration(automatic_checkpoint_naming="
                             "True, project_dir=...))")
        return Path(output_dir)
    return _checkpoints_root(project_config) / f"checkpoint_{project_config.iteration}"


def save_dir(output_dir: str | os.PathLike | None, project_config: Any) -> Path:
    """The folder `save_state(output_dir)` writes (made, and old ones rotated out, under automatic naming)."""
    out = state_dir(output_dir, project_config)
    if not project_config.automatic_checkpoint_naming:
        return out
    root = out.parent
    root.mkdir(parents=True, exist_ok=True)
    folders = sorted((str(p) for p in root.iterdir()), key=_number)
    limit = project_config.total_limit
    if limit is not None and len(folders) + 1 > limit:
        for folder in folders[: len(folders) + 1 - limit]:
            shutil.rmtree(folder)
    if out.exists():
        raise ValueError(f"checkpoint directory {out} ({project_config.iteration}) already exists; set "
                         "project_config.iteration to the iteration to continue from")
    return out


def latest_dir(input_dir: str | os.PathLike | None, project_config: Any) -> Path:
    """The folder `load_state(input_dir)` reads."""
    if input_dir is not None:
        path = Path(input_dir).expanduser()
        if not path.is_dir():
            raise ValueError(f"tried to load state from {path}, which is not a folder")
        return path
    if not project_config.automatic_checkpoint_naming:
        raise ValueError("load_state() needs an input_dir when automatic checkpoint naming is off")
    root = _checkpoints_root(project_config)
    folders = sorted((str(p) for p in root.iterdir()), key=_number) if root.is_dir() else []
    if not folders:
        raise FileNotFoundError(f"no checkpoint under {root} to load")
    return Path(folders[-1])
