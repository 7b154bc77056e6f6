"""Thread placement of concurrent host passes (a benchmark, not a test): the gradient reducer's adds on a side
thread while the optimizer's fused AdamW runs on the pass's worker pool, with the reducer's torch team at every
core (torch's default) or at its share (stream.side_threads). Writes results/host_passes/threads_side.csv.

    python -m experiments.studies.host_passes_threads [--numel 16777216] [--reps 5]
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import threading
import time
from pathlib import Path

import torch

OUT = Path("results/host_passes")


def _adamw(parts: list[tuple[torch.Tensor, ...]], pool) -> None:
    def run(t: tuple[torch.Tensor, ...]) -> None:
        p, g, m, v = t
        torch._fused_adamw_([p], [g], [m], [v], [], [torch.tensor(1.0)], amsgrad=False, lr=1e-3, beta1=0.9,
                            beta2=0.999, weight_decay=0.0, eps=1e-8, maximize=False)

    list(pool.map(run, parts))


def one_round(numel: int, side: int | None, cores: int) -> dict[str, float]:
    from megatrain.engine.parts import accumulate, fused

    pool = fused.workers(cores)
    tile = fused.TILE
    p, g, m, v = (torch.randn(numel) for _ in range(4))
    v.abs_()
    parts = [(p[a:a + tile], g[a:a + tile], m[a:a + tile], v[a:a + tile]) for a in range(0, numel, tile)]
    slab, staging, scratch = torch.zeros(numel), torch.randn(numel).bfloat16(), torch.empty(1 << 20)
    spent: dict[str, float] = {}

    def reducer() -> None:
        if side is not None:
            torch.set_num_threads(side)
        t0 = time.perf_counter()
        for _ in range(2):
            accumulate(slab, staging, scratch)
        spent["reduce_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    th = threading.Thread(target=reducer)
    th.start()
    t1 = time.perf_counter()
    _adamw(parts, pool)
    spent["adamw_s"] = time.perf_counter() - t1
    th.join()
    spent["both_s"] = time.perf_counter() - t0
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=1 << 24)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    from megatrain.engine.parts import side_threads
    from megatrain.metrics.provenance import cpu_model, git_commit

    cores = len(os.sched_getaffinity(0))
    variants = {"reducer at every core": None, f"reducer at its share ({side_threads(cores)})": side_threads(cores)}
    rows = []
    times: dict[str, list[dict[str, float]]] = {k: [] for k in variants}
    for r in range(a.reps + 1):
        for label, side in variants.items():  # alternated: drift on a shared machine hits both alike
            out = one_round(a.numel, side, cores)
            if r:
                times[label].append(out)
    commit, dirty = git_commit()
    for label, ts in times.items():
        best = min(ts, key=lambda t: t["both_s"])
        rows.append({"variant": label, "cores": cores, "numel": a.numel, "both_s_best": round(best["both_s"], 4),
                     "both_s_median": round(statistics.median(t["both_s"] for t in ts), 4),
                     "adamw_s_best": round(best["adamw_s"], 4), "reduce_s_best": round(best["reduce_s"], 4),
                     "cpu": cpu_model(), "torch": torch.__version__, "commit": commit + (" (dirty)" if dirty else ""),
                     "load_avg_1m": round(os.getloadavg()[0], 1)})
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "threads_side.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
