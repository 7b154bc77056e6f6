"""Run a sweep: select the points not yet recorded, hand them to an executor, record a row per point.

Where and how one point runs (preflight, its own subprocess, provenance) is `experiments.execute`;
where the points run (here, Ray, Slurm) is `experiments.executors`.
"""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from experiments import results as R
from experiments.execute import (
    Preflight,
    execute_point,
    last_error_line,
    preflight,
    run_point_subprocess,
)
from experiments.executors.base import Executor
from experiments.executors.local import LocalExecutor
from experiments.spec import Point, Sweep, select

# Where one point's run lived before it had its own module; still importable from here.
__all__ = ["Preflight", "SweepSummary", "default_out_dir", "execute_point", "last_error_line", "point_columns",
           "preflight", "run_point_subprocess", "run_sweep"]


@dataclass
class SweepSummary:
    out_dir: Path
    csv: Path
    ran: list[str] = field(default_factory=list)
    skipped_recorded: list[str] = field(default_factory=list)
    statuses: dict[str, str] = field(default_factory=dict)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.statuses.values():
            out[s] = out.get(s, 0) + 1
        return out


def point_columns(pt: Point, sweep_name: str) -> dict[str, Any]:
    """Row fields known before running: what the point is."""
    p = pt.preset
    return {
        "sweep": sweep_name, "point_id": pt.point_id, "label": pt.label, "backend": pt.backend,
        "model": pt.model, "family": p.family, "num_layers": p.num_layers, "hidden": p.hidden,
        "intermediate": p.intermediate, "heads": p.heads, "kv_heads": p.kv_heads, "vocab": p.vocab,
        "params": p.param_count(), "nonembed_params": p.nonembed_params(),
        "active_params": p.active_param_count(), "seq_len": pt.seq_len,
        "micro_batch": pt.micro_batch, "grad_accum": pt.grad_accum, "tokens_per_step": pt.tokens_per_step,
        "precision": pt.precision, "recompute": pt.recompute or pt.backend == "megatrain",
        "engine": json.dumps(pt.engine, sort_keys=True), "max_positions": p.max_positions,
        "grad_clip": pt.grad_clip, "warmup_steps": pt.warmup, "timed_steps": pt.steps, "threads": pt.threads,
    }


def default_out_dir(sweep: Sweep) -> Path:
    """results/<sweep name> under the caller's working directory (the checkout's results/ when run from there)."""
    return Path.cwd() / "results" / sweep.name


def run_sweep(sweep: Sweep, out_dir: str | Path | None = None, only: dict[str, set[str]] | None = None,
              force: bool = False, retry_failed: bool = False, dry_run: bool = False,
              progress: bool = True, python: str = sys.executable, log: Any = print,
              executor: Executor | None = None) -> SweepSummary:
    """Run every selected point not yet recorded; one row per point in `<out_dir>/results.csv`.

    `executor` decides where the points run (default: here, one after another); `python` is the
    interpreter of the local executor's point processes (remote nodes use their own).
    """
    from megatrain.metrics.provenance import utc_now

    # Absolute before any point starts: a point's process works elsewhere (see run_point_subprocess).
    out = Path(out_dir).absolute() if out_dir else default_out_dir(sweep)
    csv = out / "results.csv"
    summary = SweepSummary(out_dir=out, csv=csv)
    points = select(sweep.points, only or {})
    done = R.read_rows(csv)
    recorded = {} if force else dict(zip(done["point_id"].astype(str), done["status"].astype(str)))
    todo = []
    for pt in points:
        st = recorded.get(pt.point_id)
        if st is None or (retry_failed and st in ("failed", "timeout")):
            todo.append(pt)
        else:
            summary.skipped_recorded.append(pt.point_id)
    if dry_run:
        log(f"{sweep.name}: {len(points)} points selected, {len(todo)} to run, "
            f"{len(points) - len(todo)} already recorded in {csv}")
        for pt in points:
            pre = preflight(pt)
            state = "to run" if pt in todo else "recorded"
            verdict = "fits" if pre.ok else f"skip: {pre.reason}"
            log(f"  {pt.point_id}  {pt.label:<48} {state:<9} {verdict}")
        return summary
    if not todo:
        log(f"{sweep.name}: all {len(points)} selected points are already recorded in {csv} (--force redoes them)")
        return summary

    out.mkdir(parents=True, exist_ok=True)
    bar = None
    # Ticking the elapsed time of the point in flight helps on a terminal; in a log file it would
    # write a line every half second, so there only whole points advance the bar.
    live = progress and sys.stderr.isatty()
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(todo), desc=sweep.name, unit="pt", dynamic_ncols=True,
                   mininterval=0.5 if live else 30.0)

    def tick(text: str) -> None:
        if bar is not None:
            bar.set_postfix_str(text, refresh=live)

    executor = executor or LocalExecutor()
    try:
        # closing(): leaving the loop early (Ctrl-C, a write error) stops the points still running.
        with contextlib.closing(executor.run(todo, out, python=python, on_tick=tick)) as finished:
            for pt, fields in finished:
                row = point_columns(pt, sweep.name)
                row.update(fields)
                row["timestamp"] = utc_now()
                R.append_row(csv, row)
                summary.ran.append(pt.point_id)
                summary.statuses[pt.point_id] = row["status"]
                if bar is not None:
                    bar.update(1)
                    if row["status"] != "ok":
                        bar.write(f"{pt.label}: {row['status']}: {row.get('reason', '')}")
    finally:
        if bar is not None:
            bar.close()
        with contextlib.suppress(OSError):
            (out / ".work").rmdir()  # scratch for result hand-off; only removed when empty
    if force or retry_failed:
        # A redo appended a second row for the point; keep one row per point on disk too.
        R.compact(csv)
    counts = summary.counts()
    log(f"{sweep.name}: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) + f" -> {csv}")
    return summary
