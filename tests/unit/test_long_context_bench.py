"""The long-context bench end to end on a tiny model: rows, budget enforcement, merge, the planner column,
the report rebuilt from the CSV."""

from __future__ import annotations

import csv
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from experiments.studies import long_context as bench


def _rows(out: Path) -> list[dict]:
    with (out / "results.csv").open() as f:
        return list(csv.DictReader(f))


def _side_by_side(monkeypatch, pool: ThreadPoolExecutor, points: list[tuple[str, int]]) -> dict[tuple, Future]:
    """bench.run_point, each of `points` ((backend, seq)) started together in its own process at the first call
    (the real run_point, the first call's model, budget and limits; its log in the first call's log folder), its
    row handed over when a sweep asks for that point; any other point runs when asked, as before. The points read
    nothing from each other (each its own process and budget tracker), so the rows are the sequential run's.
    Returns the started points, each popped once a sweep asks for it."""
    real = bench.run_point
    started: dict[tuple, Future] = {}
    first = []

    def run_point(model: str, backend: str, seq: int, max_pos: int, budget: int, timeout_s: float, log_dir: Path,
                  alst_loss_tile: int | None = None) -> dict[str, Any]:
        key = (model, max_pos, budget, timeout_s, alst_loss_tile)
        if not first:
            first.append(key)
            for b, n in points:
                started[(b, n, *key)] = pool.submit(real, model, b, n, max_pos, budget, timeout_s, log_dir,
                                                    alst_loss_tile)
        got = started.pop((backend, seq, *key), None)
        return (got.result() if got is not None else
                real(model, backend, seq, max_pos, budget, timeout_s, log_dir, alst_loss_tile))

    monkeypatch.setattr(bench, "run_point", run_point)
    return started


@pytest.mark.slow
def test_bench_runs_merges_and_reports(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["bench"])
    # The four points the two sweeps below try run side by side (the bench itself runs them one after another).
    pool = ThreadPoolExecutor(4)
    try:
        _bench_runs_merges_and_reports(tmp_path, _side_by_side(monkeypatch, pool, [
            ("megatrain", 128), ("megatrain", 2048), ("torch", 128), ("torch", 2048)]))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _bench_runs_merges_and_reports(tmp_path: Path, started: dict[tuple, Future]) -> None:
    common = ["--model", "tiny", "--budget-gib", "0.004", "--lengths", "128,2048", "--out", str(tmp_path)]
    assert bench.main([*common, "--backends", "megatrain"]) == 0
    rows = _rows(tmp_path)
    assert [r["seq_len"] for r in rows] == ["128", "2048"]
    ok = [r for r in rows if r["fits"] == "True"]
    assert ok and all(float(r["peak_device_bytes"]) <= float(r["budget_bytes"]) for r in ok)
    over = [r for r in rows if r["status"] == "over_budget"]
    assert over and float(over[0]["peak_device_bytes"]) > float(over[0]["budget_bytes"])  # the budget is enforced
    # --merge keeps the megatrain rows.
    assert bench.main([*common, "--backends", "torch", "--merge"]) == 0
    rows = _rows(tmp_path)
    assert {r["backend"] for r in rows} == {"megatrain", "torch"}
    readme = (tmp_path / "README.md").read_text()
    assert "Memory model (`megatrain plan`" in readme and "| megatrain | 128 | ok |" in readme
    with pytest.raises(SystemExit, match="--merge"):
        bench.main([*common[:2], "--budget-gib", "0.008", *common[4:], "--backends", "torch", "--merge"])
    # The report alone is rebuilt from the CSV and the saved provenance.
    (tmp_path / "README.md").unlink()
    assert bench.main([*common, "--report-only"]) == 0
    assert "| torch | 2048 | over_budget |" in (tmp_path / "README.md").read_text()
    assert not started  # every point started side by side was one a sweep asked for: none ran for nothing


def test_bisect_brackets_the_limit(tmp_path: Path, monkeypatch) -> None:
    """--bisect: after the first length over budget, halve the gap to the longest that fit (a fake point whose
    limit is 2,900 tokens, so no process runs)."""
    tried = []

    def fake(model, backend, seq, max_pos, budget, timeout_s, log_dir, alst_loss_tile=None):
        tried.append(seq)
        ok = seq <= 2900
        return {"model": model, "backend": backend, "seq_len": seq, "budget_bytes": budget, "fits": ok,
                "status": "ok" if ok else "over_budget", "reason": "", "peak_device_bytes": seq, "wall_s": 0.0}

    monkeypatch.setattr(bench, "run_point", fake)
    monkeypatch.setattr(sys, "argv", ["bench"])
    assert bench.main(["--model", "tiny", "--budget-gib", "0.004", "--lengths", "1024,2048,4096,8192",
                       "--bisect", "256", "--backends", "torch", "--out", str(tmp_path)]) == 0
    assert tried == [1024, 2048, 4096, 3072, 2560, 2816]  # 8192 never: 4096 was already over
    readme = (tmp_path / "README.md").read_text()
    assert "| torch | 2816 | 3072 (over_budget: ) |" in readme
