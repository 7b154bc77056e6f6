"""What the engine asks of a placement advisor: residency "auto" placed by a timing model instead of the engine's
fixed fill order (kept weights, then graphs; costs/memory.py). The planner's search implements it
(planner/advice.py); the backend, which sees both, hands it to the engine on a device it has a profile for. Plain
typing, no torch: the engine depends on this shape, not on the planner."""

from __future__ import annotations

from typing import Any, Protocol

from .residency import Residency


class PlacementAdvice(Protocol):
    source: str  # what placed it, for the run's start line

    def optimizer_layers(self, config: Any, budget: int) -> int:
        """The optimizer-resident count for an engine being built with `config` (its EngineConfig) under
        `budget` device bytes."""
        ...

    def residency(self, config: Any, tokens: int, budget: int, optimizer: int) -> Residency | None:
        """The placement of a training batch of `tokens` with `optimizer` layers fixed on the device (None: no
        advice, the engine's own fill)."""
        ...
