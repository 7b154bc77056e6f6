"""The start line of a run that trains on real DeepSpeed: MegaTrain's own start line names MegaTrain
(`megatrain/run/start_line.py`); this one names DeepSpeed and why, so every run that passes through an installed
megatrain says which engine trains.

Two reasons a config reaches real DeepSpeed: the user left it there on purpose (`MEGATRAIN_DEEPSPEED_GUARD=0`, the
one opt-out), or the config has no "megatrain" section and the script was not started by `megatrain launch`.
`install()` wraps `deepspeed.initialize` to say so; the routing (`hf.py`) says it itself for what it passes on.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

from ..files import env

__all__ = ["PREFIX", "GUARD_ENV", "left_on_deepspeed", "announce", "install"]

PREFIX = "DeepSpeed is training"
GUARD_ENV = env.DEEPSPEED_GUARD
NO_SECTION = ('the config has no "megatrain" section and the script was not started by `megatrain launch` '
              "(add the section or use `megatrain launch` to train on MegaTrain)")
LEFT = f"left on DeepSpeed by {GUARD_ENV}=0"


def left_on_deepspeed() -> bool:
    """Whether the user left DeepSpeed untouched in this process (the opt-out)."""
    return env.deepspeed_left_alone()


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


def announce(reason: str) -> None:
    """One line on the launch's main process, to stderr (as MegaTrain's own start line when logging is quiet)."""
    if _rank() == 0:
        print(f"[megatrain] {PREFIX} | engine: DeepSpeedEngine (real DeepSpeed) | {reason}", file=sys.stderr,
              flush=True)


_installed: list[Any] = []


def install() -> None:
    """With the opt-out set: leave `deepspeed.initialize` to DeepSpeed, saying so at each call (idempotent; nothing
    without the opt-out, where the routing says it for what it passes on)."""
    import deepspeed

    if _installed or not left_on_deepspeed() or getattr(deepspeed, "__name__", "") != "deepspeed":
        return  # the name is MegaTrain's own namespace (a shim): MegaTrain trains and says so itself
    real = deepspeed.initialize

    @functools.wraps(real)
    def initialize(*args: Any, **kwargs: Any) -> Any:
        announce(LEFT)
        return real(*args, **kwargs)

    _installed.append(real)
    deepspeed.initialize = initialize


install()
