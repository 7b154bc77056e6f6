"""`deepspeed.zero`: `Init` and `GatheredParameters`, for scripts and libraries written for ZeRO-3.

MegaTrain never partitions a parameter: the model is built whole on the host and its parameters are the
engine's host masters, so these only keep the engine's copies consistent with what the script reads and writes.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = ["Init", "GatheredParameters"]


class _NoOpContext(contextlib.ContextDecorator):
    """Stands in for deepspeed.zero.Init: the model is built whole on the host, as it is."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __enter__(self) -> _NoOpContext:
        return self

    def __exit__(self, *exc: Any) -> bool:
        return False


class GatheredParameters(contextlib.ContextDecorator):
    """`deepspeed.zero.GatheredParameters`: the parameters are whole already (the model object's parameters are
    the engine's host masters); entering waits for queued updates so reads are current, and with a
    `modifier_rank` leaving hands what was written to the engine (its device and bf16 copies follow)."""

    def __init__(self, params: Any, modifier_rank: int | None = None, fwd_module: Any = None,
                 enabled: bool = True) -> None:
        # The engine is imported once a script gathers, not by `import megatrain as deepspeed`.
        from ..engine import engines_holding

        params = [params] if torch.is_tensor(params) else list(params or [])
        self._engines = engines_holding(params) if enabled else []
        self._modifier_rank = modifier_rank

    def __enter__(self) -> GatheredParameters:
        for eng in self._engines:
            eng.synchronize()
        return self

    def __exit__(self, *exc: Any) -> bool:
        if self._modifier_rank is not None:
            for eng in self._engines:
                eng.params_written(self._modifier_rank)
        return False


Init = _NoOpContext
