"""`deepspeed.utils`: the logger and `log_dist` that training scripts call."""

from __future__ import annotations

import logging
from collections.abc import Sequence

__all__ = ["logger", "log_dist"]

logger = logging.getLogger("megatrain")


def log_dist(message: str, ranks: Sequence[int] | None = None, level: int = logging.INFO) -> None:
    """Log `message` if this process's rank (always 0 here) is in `ranks`; None or [-1] means every rank."""
    if ranks is None or -1 in ranks or 0 in ranks:
        if not logger.handlers and not logging.getLogger().handlers:
            # As DeepSpeed's logger, it is meant to be seen: without any configured handler the record would drop.
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("[megatrain] %(message)s"))
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
        logger.log(level, "[Rank 0] %s", message)
