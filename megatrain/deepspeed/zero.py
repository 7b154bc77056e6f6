"""`deepspeed.zero` (also `deepspeed.runtime.zero.partition_parameters`): `Init`, `GatheredParameters`,
`ZeroParamStatus`, for scripts and libraries written for ZeRO-3.

MegaTrain never partitions a parameter: the model is built whole on the host and its parameters are the
engine's host masters, so these only keep the engine's copies consistent with what the script reads and writes.
A parameter here has no `ds_id` / `ds_status`: code that asks `hasattr(p, "ds_id")` before gathering (DeepSpeed-Chat's
`_z3_params_to_fetch`) finds nothing to fetch, as DeepSpeed at stages 0-2.
"""

from __future__ import annotations

import contextlib
import enum
from typing import Any

import torch

__all__ = ["Init", "GatheredParameters", "ZeroParamStatus", "register_external_parameter",
           "unregister_external_parameter"]


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's states of a partitioned parameter (same names and values); a parameter here is always whole."""

    AVAILABLE = 1  # the whole parameter is there
    NOT_AVAILABLE = 2  # partitioned away (never, on MegaTrain)
    INFLIGHT = 3  # being gathered (never, on MegaTrain)


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """ZeRO-3's note that `module` uses a parameter it does not own: nothing is gathered on use here."""


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Undo `register_external_parameter`: nothing to undo."""


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
