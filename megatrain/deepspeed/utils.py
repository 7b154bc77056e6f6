"""`deepspeed.utils`: the logger and `log_dist` that training scripts call."""

from __future__ import annotations

import logging
from collections.abc import Sequence

__all__ = ["logger", "log_dist"]

logger = logging.getLogger("megatrain")


def _make_visible() -> None:
    # As DeepSpeed's logger, it is meant to be seen (log_dist, steps_per_print, wall_clock_breakdown): without any
    # configured handler an INFO record would be dropped, so give the logger one of its own, once.
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[megatrain] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def log_visible(msg: str, *args: object) -> None:
    """An INFO line the user asked for (the engine's step and timing reports)."""
    _make_visible()
    logger.info(msg, *args)


def log_dist(message: str, ranks: Sequence[int] | None = None, level: int = logging.INFO) -> None:
    """Log `message` if this process's rank is in `ranks`; None or [-1] means every rank (as DeepSpeed's)."""
    from .comm import get_rank

    rank = get_rank()
    if ranks is None or -1 in ranks or rank in ranks:
        _make_visible()
        logger.log(level, "[Rank %d] %s", rank, message)
