"""Where a sweep's points run: this machine (`local`), a Ray cluster (`ray`) or Slurm (`slurm`).

Every executor takes the points still to run and yields `(point, row fields)` as each finishes;
the runner alone turns those into results rows, so selection, skipping recorded points, the CSV
and the progress bar are one piece of code whatever runs the points.
"""

from __future__ import annotations

from typing import Any

from experiments.executors.base import Executor, ExecutorError, run_point_job

EXECUTORS = ("local", "ray", "slurm")


def make_executor(name: str, **options: Any) -> Executor:
    """The executor called `name`; options it does not use are ignored (the CLI passes them all)."""
    if name == "local":
        from experiments.executors.local import LocalExecutor

        return LocalExecutor()
    if name == "ray":
        from experiments.executors.ray_exec import RayExecutor

        return RayExecutor(address=options.get("address"), cluster_cpus=options.get("cluster_cpus"),
                           cpus_per_point=options.get("cpus_per_point") or 1,
                           gpus_per_point=options.get("gpus_per_point") or 0)
    if name == "slurm":
        from experiments.executors.slurm import SlurmExecutor

        return SlurmExecutor(partition=options.get("partition"), cpus_per_point=options.get("cpus_per_point") or 1,
                             gpus_per_point=options.get("gpus_per_point") or 0)
    raise ExecutorError(f"unknown executor {name!r}; known: {', '.join(EXECUTORS)}")


__all__ = ["EXECUTORS", "Executor", "ExecutorError", "make_executor", "run_point_job"]
