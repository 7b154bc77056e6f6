"""The test kit: what many tests need, written once (import it as `from kit import ...`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from megatrain.engine import Engine


def engine_factory(residency: Any = "stream", engines: list | None = None, **extra: Any) -> Callable[..., Engine]:
    """An engine factory for the parity probe (`run_probe(cls, config, factory)`) that trains with `residency` and
    the settings in `extra` over the probe's own, keeping each engine it makes in `engines` (when given)."""
    def make(model, cfg, optimizer=None) -> Engine:
        eng = Engine(model, dataclasses.replace(cfg, residency=residency, **extra), optimizer=optimizer)
        if engines is not None:
            engines.append(eng)
        return eng
    return make


def kept_graphs(engines: list) -> int:
    """How many layers kept their forward graph in the last training step of the last engine made."""
    return int(engines[-1].pipeline.residency_stats()["kept_graph_layers"])
