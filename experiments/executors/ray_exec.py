"""Points as Ray tasks: each task runs one point's isolated subprocess on whichever node it lands.

The driver (this process) is the only writer of results.csv: rows are recorded as tasks finish,
so the CSV stays crash-safe and an interrupted sweep resumes exactly as a local one does.
"""

from __future__ import annotations

import logging
import re
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

_HOST_PORT = re.compile(r"^[A-Za-z0-9.\-]+:(\d{1,5})$")
_CLIENT = re.compile(r"^ray://[A-Za-z0-9.\-]+(:\d{1,5})?$")


def check_address(address: str | None) -> None:
    """Reject an address Ray could only fail on later, naming it: `auto`, `local`,
    `ray://HOST[:PORT]` (Ray Client) or `HOST:PORT` (the head's GCS)."""
    if address is None or address in ("auto", "local"):
        return
    m = _HOST_PORT.match(address)
    ok = bool(_CLIENT.match(address)) or (m is not None and 0 < int(m.group(1)) < 65536)
    if not ok:
        raise ExecutorError(f"--address {address!r}: not a Ray address; expected 'auto' (the cluster this "
                            "machine belongs to), 'ray://HOST[:PORT]' or HOST:PORT")


class RayExecutor(Executor):
    name = "ray"

    def __init__(self, address: str | None = None, cluster_cpus: int | None = None,
                 cpus_per_point: float = 1, gpus_per_point: float = 0) -> None:
        check_address(address)
        self.ray = import_optional("ray", "ray")  # fail before the sweep starts, not after the first preflight
        self.address, self.cluster_cpus = address, cluster_cpus
        self.cpus_per_point, self.gpus_per_point = cpus_per_point, gpus_per_point

    def _connect(self) -> bool:
        """Join or start a cluster; True when this executor started it (and so shuts it down)."""
        ray = self.ray
        if ray.is_initialized():  # a caller's own session (a notebook, the tests): use it as is
            return False
        kw: dict[str, Any] = {"logging_level": logging.WARNING, "include_dashboard": False}
        if self.address is None:
            # "local", not None: None would join whatever cluster this machine ran last.
            kw.update(address="local", num_cpus=self.cluster_cpus)
        else:
            kw["address"] = self.address
        try:
            ray.init(**kw)
        except (ConnectionError, ValueError, RuntimeError) as e:
            where = self.address or "a local cluster"
            raise ExecutorError(f"--address {where!r}: cannot start or join the Ray cluster: {e}") from None
        return True

    def run(self, points: Sequence[Point], out_dir: Path, python: str,
            on_tick: Tick | None = None) -> Iterator[tuple[Point, dict[str, Any]]]:
        ray = self.ray
        started = self._connect()
        # No retries: a point that dies is recorded as failed, as locally; --retry-failed reruns it.
        task = ray.remote(run_point_job).options(num_cpus=self.cpus_per_point, num_gpus=self.gpus_per_point,
                                                 max_retries=0, name="megatrain-point")
        out = str(Path(out_dir).resolve())  # a worker's working directory is not ours
        pending = {task.remote(pt.to_dict(), out): pt for pt in points}
        t0 = time.monotonic()
        try:
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1, timeout=0.5)
                if on_tick is not None:
                    on_tick(f"{len(pending)} in flight {time.monotonic() - t0:.0f}s")
                for ref in done:
                    pt = pending.pop(ref)
                    try:
                        fields = ray.get(ref)
                    except ray.exceptions.TaskCancelledError as e:
                        fields = lost_job_fields("ray task cancelled", str(e))
                    except ray.exceptions.RayError as e:
                        fields = lost_job_fields(f"ray task failed ({type(e).__name__})", str(e))
                    yield pt, fields
        finally:
            # Interrupted or abandoned: stop what still runs (force kills the worker, and the point's
            # process dies with its parent); none of it is recorded, so a rerun picks it up.
            for ref in pending:
                ray.cancel(ref, force=True)
            if started:
                ray.shutdown()
