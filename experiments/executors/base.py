"""The interface the runner drives, and the job every remote executor runs on its node."""

from __future__ import annotations

import abc
import importlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from experiments.spec import Point

INSTALL_HINT = "pip install 'megatrain[cluster]'"


def import_optional(module: str, executor: str) -> Any:
    """The cluster package an executor needs, or an error saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ExecutorError(f"--executor {executor} needs the {module} package: {INSTALL_HINT}") from None

# Called with a short status text while points run (the progress bar's postfix).
Tick = Callable[[str], None]


class ExecutorError(RuntimeError):
    """An executor cannot start: a missing package, a bad address, no scheduler."""


class Executor(abc.ABC):
    name: str = ""

    @abc.abstractmethod
    def run(self, points: Sequence[Point], out_dir: Path, python: str,
            on_tick: Tick | None = None) -> Iterator[tuple[Point, dict[str, Any]]]:
        """Run every point; yield `(point, fields)` as each one finishes, in any order.

        `fields` are the row columns the point produced where it ran (preflight, status, metrics,
        provenance). A point whose job died is still yielded, as `failed` or `timeout`, so it is
        recorded like a point whose process died locally. Closing the iterator early (Ctrl-C, an
        error in the caller) must stop the points still running: they are not recorded and run
        again on the next invocation.
        """


def run_point_job(point: dict[str, Any], out_dir: str) -> dict[str, Any]:
    """A point's whole job on a cluster node: preflight against that node, the isolated run, that
    node's provenance. Module-level and plain-typed so Ray and submitit can pickle it by name."""
    from experiments.execute import execute_point

    return execute_point(Point.from_dict(point), Path(out_dir))


def lost_job_fields(what: str, detail: str, timed_out: bool = False) -> dict[str, Any]:
    """Row fields for a point whose job ended without returning a row (killed, cancelled, node
    lost): `failed`, or `timeout` when the scheduler's time limit stopped it, as the local runner
    records a point whose process died."""
    from experiments.execute import last_error_line

    line = last_error_line(detail)
    if timed_out:
        return {"status": "timeout", "reason": f"{what} hit its time limit; last output: {line}"}
    return {"status": "failed", "reason": f"{what}: {line}"}
