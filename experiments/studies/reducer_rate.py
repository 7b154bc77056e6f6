"""How far backward's gradient reducer runs from its bytes bound on this host (a benchmark, not a test): the
engine's own reduction of one layer (engine/pipeline/schedule.py `accumulate` from bf16 staging into the FP32 slab,
then the slab's norm, as engine/host/slab_state.py runs it) on the reducer's threads (engine/runtime/stream.py
`side_threads()`), against `copy_` bandwidth measured on the same threads right before and after (paired, as
experiments/studies/host_passes.py pairs its passes). The planner's reducer rate (planner/host_rates.py "reducer")
is this ratio. Beside it, the rounding (on its own worker) of the resident parameters' FP32 masters into their bf16 upload
staging (engine/host/resident_upload.py: one `copy_`, on every torch thread), against `copy_` on every thread: the
planner's "resident rounding" rate. Writes results/reducer_rate/reducer_rate.csv.

    python -m experiments.studies.reducer_rate [--numel 16777216] [--reps 7]

Bytes counted per element: the first reduction after zero_grad writes 0 + g (read 2, write 4), a later one adds
(read 2, read + write 8); the norm reads the slab again (4).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from pathlib import Path

import torch

OUT = Path("results/reducer_rate")
VARIANTS = {"first (0 + g) + norm": (True, 2 + 4 + 4), "add + norm": (False, 2 + 8 + 4)}


def copy_bps(a: torch.Tensor, b: torch.Tensor) -> float:
    t0 = time.perf_counter()
    b.copy_(a)
    return 2 * a.numel() * a.element_size() / (time.perf_counter() - t0)


def measure(numel: int, reps: int) -> list[dict]:
    from megatrain.engine.parts import REDUCE_CHUNK, accumulate, side_threads

    before = torch.get_num_threads()
    threads = side_threads(before)
    torch.set_num_threads(threads)
    try:
        slab = torch.zeros(numel)
        staging = torch.randn(numel).to(torch.bfloat16)
        scratch = torch.empty(REDUCE_CHUNK)
        a, b = torch.ones(numel), torch.empty(numel)
        b.copy_(a)
        rows = []
        for name, (first, per_elem) in VARIANTS.items():
            accumulate(slab, staging, scratch, first)  # warm
            ratios, secs = [], []
            for _ in range(reps):
                bw0 = copy_bps(a, b)
                t0 = time.perf_counter()
                accumulate(slab, staging, scratch, first)
                torch.linalg.vector_norm(slab)
                s = time.perf_counter() - t0
                bw = statistics.median([bw0, copy_bps(a, b)])
                secs.append(s)
                ratios.append(s / (numel * per_elem / bw))
            rows.append({"variant": name, "threads": threads, "cores": before, "numel": numel,
                         "bytes_per_param": per_elem, "seconds_median": statistics.median(secs),
                         "x_bound_median": statistics.median(ratios), "x_bound_best": min(ratios),
                         "loadavg": os.getloadavg()[0]})
    finally:
        torch.set_num_threads(before)
    rows.append(_rounding(numel, reps, before))
    return rows


def _rounding(numel: int, reps: int, threads: int) -> dict:
    """The resident masters' FP32 -> bf16 rounding (read 4, write 2 per element) on every thread."""
    master, staging = torch.randn(numel), torch.empty(numel, dtype=torch.bfloat16)
    a, b = torch.ones(numel), torch.empty(numel)
    b.copy_(a)
    staging.copy_(master)
    ratios, secs = [], []
    for _ in range(reps):
        bw0 = copy_bps(a, b)
        t0 = time.perf_counter()
        staging.copy_(master)
        s = time.perf_counter() - t0
        bw = statistics.median([bw0, copy_bps(a, b)])
        secs.append(s)
        ratios.append(s / (numel * 6 / bw))
    return {"variant": "resident rounding (FP32 -> bf16)", "threads": threads, "cores": threads, "numel": numel,
            "bytes_per_param": 6, "seconds_median": statistics.median(secs), "x_bound_median": statistics.median(ratios),
            "x_bound_best": min(ratios), "loadavg": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=1 << 24)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)

    from megatrain.metrics.provenance import provenance

    rows = measure(args.numel, args.reps)
    prov = provenance()
    extra = {k: prov[k] for k in ("git_commit", "git_dirty", "cpu_model", "cpu_count")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "reducer_rate.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[*rows[0], *extra, "torch"])
        w.writeheader()
        for r in rows:
            w.writerow({**r, **extra, "torch": torch.__version__})
    for r in rows:
        print(f"{r['variant']}: {r['threads']} of {r['cores']} threads, {r['seconds_median'] * 1e3:.1f} ms, "
              f"{r['x_bound_median']:.2f}x its bytes bound (best {r['x_bound_best']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
