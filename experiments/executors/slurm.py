"""Points as Slurm jobs through submitit: one job per point, each running the point's isolated
subprocess on its node. The driver (this process) polls the jobs and is the only writer of
results.csv, so an interrupted sweep resumes as a local one does.

`cluster="local"` runs the same jobs through submitit's local executor (a process per job on this
machine): the tests use it, having no Slurm.
"""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from experiments.executors.base import (
    Executor,
    ExecutorError,
    Tick,
    import_optional,
    lost_job_fields,
    run_point_job,
)
from experiments.spec import Point

# Slurm's limit sits above the point's own timeout_s: the point's runner then stops it and records
# `timeout` with its last output, and Slurm's kill stays a backstop for a wedged job.
LIMIT_MARGIN_MIN = 5
_POLL_S = 1.0


def time_limit_min(pt: Point) -> int:
    """The job's time limit in whole minutes (Slurm's unit) for a point's timeout_s."""
    return math.ceil(pt.timeout_s / 60) + LIMIT_MARGIN_MIN


class SlurmExecutor(Executor):
    name = "slurm"

    def __init__(self, partition: str | None = None, cpus_per_point: int = 1, gpus_per_point: int = 0,
                 cluster: str = "slurm") -> None:
        self.submitit = import_optional("submitit", "slurm")
        if cluster == "slurm" and shutil.which("sbatch") is None:
            raise ExecutorError("--executor slurm: no Slurm here (sbatch not found); run the sweep from a "
                                "machine that submits Slurm jobs")
        self.partition, self.cluster = partition, cluster
        self.cpus_per_point, self.gpus_per_point = int(cpus_per_point), int(gpus_per_point)

    def _executor(self, out_dir: Path) -> Any:
        # Slurm's own stdout/stderr per job (named by job id), next to the points' logs.
        ex = self.submitit.AutoExecutor(folder=str(out_dir / "slurm"), cluster=self.cluster)
        params: dict[str, Any] = {"nodes": 1, "tasks_per_node": 1, "cpus_per_task": self.cpus_per_point,
                                  "gpus_per_node": self.gpus_per_point}
        if self.partition:
            params["slurm_partition"] = self.partition
        ex.update_parameters(**params)
        return ex

    def run(self, points: Sequence[Point], out_dir: Path, python: str,
            on_tick: Tick | None = None) -> Iterator[tuple[Point, dict[str, Any]]]:
        utils = self.submitit.core.utils
        out = Path(out_dir).resolve()  # a job's working directory is not ours
        ex = self._executor(out)
        pending: dict[Any, Point] = {}
        t0 = time.monotonic()
        try:
            for pt in points:
                ex.update_parameters(timeout_min=time_limit_min(pt), name=f"megatrain-{pt.point_id}")
                try:
                    pending[ex.submit(run_point_job, pt.to_dict(), str(out))] = pt
                except (OSError, RuntimeError) as e:  # sbatch refused (partition, account, limits)
                    raise ExecutorError(f"--executor slurm: submitting {pt.label} failed: {e}") from None
            while pending:
                finished = [job for job in pending if job.done()]
                if on_tick is not None:
                    on_tick(f"{len(pending)} in flight {time.monotonic() - t0:.0f}s")
                if not finished:
                    time.sleep(_POLL_S)
                for job in finished:
                    pt = pending.pop(job)
                    try:
                        fields = job.result()
                    except utils.UncompletedJobError as e:  # FailedJobError included
                        state = str(job.state)
                        fields = lost_job_fields(f"{self.cluster} job {job.job_id} {state}", str(e),
                                                 timed_out=state.upper().startswith("TIMEOUT"))
                    yield pt, fields
        finally:
            # Interrupted or abandoned: cancel what still runs; none of it is recorded, so a rerun
            # picks it up.
            for job in pending:
                try:
                    job.cancel(check=False)
                except OSError:
                    pass
