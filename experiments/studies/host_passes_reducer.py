"""Backward's reduction of one layer against its bytes bound: the one-pass kernel (engine/host/reduce_kernel.py)
and the two torch passes it replaces (a benchmark, not a test; its result is committed under
results/host_passes/reducer.md).

    python -m experiments.studies.host_passes_reducer [--numel 16777216] [--reps 11]

One layer-sized FP32 slab and its bf16 staging (what backward's gradients land in on CUDA). Timed per repetition,
on one thread (the reducer's here, and the kernel's: its norm is one sequential loop): the reduction as the engine
runs it (SlabState.reduce with the norm measured), first after zero_grad (the slab written as 0 + g) and adding,
each paired with `copy_` of an FP32 tensor as large, on the same thread, right before and after it (the load of a
shared machine drifts; host_passes.py pairs its rounds the same way). Bytes counted per element: the bf16
gradient read (2), the slab read (4) and written (4): 10, for the first reduction too (the write fetches the line it
writes). x bound = time / (bytes / the paired copy_ bandwidth, read + written).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch

BYTES_PER_PARAM = 10


def _copy_rate(a: torch.Tensor, b: torch.Tensor) -> float:
    t0 = time.perf_counter()
    b.copy_(a)
    return 8 * a.numel() / (time.perf_counter() - t0)


def measure(numel: int, reps: int) -> dict[tuple[bool, str], list[float]]:
    """x bound per repetition, for (the one pass or not, "first" or "add"); the variants interleaved per repetition
    so a shared machine's load falls on both alike."""
    from megatrain.engine.parts import PartsAdd, SlabState, accumulate

    slab = torch.zeros(numel)
    staging = (torch.randn(numel) * 1e-3).to(torch.bfloat16)
    scratch = torch.empty(1 << 16)
    a, b = torch.ones(numel), torch.empty(numel)
    state = SlabState(1)
    state.overwrite = True

    def add(first: bool) -> None:
        accumulate(slab, staging, scratch, first)

    out: dict[tuple[bool, str], list[float]] = {}
    for _ in range(reps + 1):
        for fused in (True, False):
            adds = PartsAdd(add, [(0, staging)]) if fused else add
            for what in ("first", "add"):
                if what == "first":
                    state.zero(0, slab)  # a flag: the next reduction writes 0 + g
                before = _copy_rate(a, b)
                t0 = time.perf_counter()
                state.reduce(0, slab, adds, True)
                t = time.perf_counter() - t0
                after = _copy_rate(a, b)
                bound = BYTES_PER_PARAM * numel / ((before + after) / 2)
                out.setdefault((fused, what), []).append(t / bound)
    return {k: v[1:] for k, v in out.items()}  # the first round warms the pages


def main(argv: list[str] | None = None) -> int:
    from megatrain.engine.parts import reduce_kernel

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=1 << 24)
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--out", default="results/host_passes/reducer.md")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    if reduce_kernel.kernel() is None:
        raise SystemExit("no compiled reduce kernel here (no C compiler?): nothing to compare")
    got = measure(a.numel, a.reps)
    rows = [(name, {w: got[(fused, w)] for w in ("first", "add")})
            for fused, name in ((True, "one pass (reduce_kernel)"), (False, "two torch passes (accumulate, vector_norm)"))]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = ["# Backward's reduction of one layer against its bytes bound", "",
             "Written by `python -m experiments.studies.host_passes_reducer` (its docstring says what is timed and "
             "how the bound is counted).", "",
             f"- {a.numel} elements (a layer), bf16 staging into an FP32 slab, the norm measured; 1 thread; "
             f"{a.reps} repetitions, each against `copy_` right before and after it",
             f"- machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f} (shared); commit {commit}", "",
             "| pass | reduction | x bound (10 B/param), best | median |", "|---|---|---:|---:|"]
    for name, r in rows:
        for what in ("first", "add"):
            lines.append(f"| {name} | {what} | {min(r[what]):.2f} | {statistics.median(r[what]):.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
