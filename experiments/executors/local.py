"""Points one after another on this machine, each in its own subprocess (the default)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from experiments.executors.base import Executor, Tick
from experiments.spec import Point


class LocalExecutor(Executor):
    name = "local"

    def run(self, points: Sequence[Point], out_dir: Path, python: str,
            on_tick: Tick | None = None) -> Iterator[tuple[Point, dict[str, Any]]]:
        from experiments.execute import execute_point
        from megatrain.metrics.provenance import provenance

        prov = provenance()  # one machine: its git and package lookups once, not per point
        for pt in points:
            if on_tick is not None:
                on_tick(pt.label)

            def tick(elapsed: float, _pt: Point = pt) -> None:
                if on_tick is not None:
                    on_tick(f"{_pt.label} {elapsed:.0f}s")

            yield pt, execute_point(pt, out_dir, python=python, on_tick=tick, prov=prov)
