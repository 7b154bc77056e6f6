"""Thread placement for the fused per-layer host pass (a benchmark, not a test; results in results/host_passes/).

    python -m experiments.studies.host_threads [--reps 7] [--numel 12650496]

One hilo layer (and one FP32 + bf16 shadow layer) of `--numel` parameters is updated by engine/update/fused.py
with its tiles shared between 1, 2 and 4 worker threads (one torch thread each), against the whole-layer
passes with torch's own OpenMP team ("unfused"), and two layers updated at once (two callers, the workers
split between them) against one after the other. Each round's time is paired with the copy bandwidth
measured just before it (x bound = time / (28 B per parameter at that bandwidth)); the best and median over
`--reps` rounds are written to results/host_passes/threads.csv and printed.
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

from experiments.studies.host_passes import copy_bandwidth
from megatrain.costs.modes import GradSlab, HostMaster
from megatrain.engine.parts import FlatGroup, Scratch, fused

OUT = Path("results/host_passes")


def layer(master: HostMaster, numel: int, seed: int) -> tuple[FlatGroup, torch.optim.Optimizer]:
    scratch = Scratch(numel, master is not HostMaster.FP32, False)
    g = FlatGroup([("w", torch.Size([numel]))], torch.bfloat16 if master is HostMaster.FP32 else None, master,
                  GradSlab.FLOAT32, scratch)
    gen = torch.Generator().manual_seed(seed)
    g.write_slot(g.slots[0], torch.randn(numel, generator=gen))
    g.refresh_shadow()
    g.grad.copy_(torch.randn(numel, generator=gen) * 1e-3)
    opt = torch.optim.AdamW(g.params, lr=1e-3, fused=True)
    g.unpack()
    opt.step()  # the state
    g.pack()
    return g, opt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--numel", type=int, default=12_650_496)  # one llama-100m decoder layer
    a = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    rows = []
    for master in (HostMaster.HILO, HostMaster.FP32):
        (g1, o1), (g2, o2) = layer(master, a.numel, 0), layer(master, a.numel, 1)
        per = 30 if master is HostMaster.FP32 else 28

        def unfused(g=g1, o=o1) -> None:
            g.load_grads([0.5])
            g.unpack()
            o.step()
            g.pack()

        def two_at_once(g1=g1, o1=o1, g2=g2, o2=o2) -> None:
            t = threading.Thread(target=fused.fused_update, args=(o2, g2, [0.5]), kwargs={"threads": max(1, cores // 2)})
            t.start()
            fused.fused_update(o1, g1, [0.5], threads=max(1, cores // 2))
            t.join()

        def one_after_other(g1=g1, o1=o1, g2=g2, o2=o2) -> None:
            fused.fused_update(o1, g1, [0.5], threads=cores)
            fused.fused_update(o2, g2, [0.5], threads=cores)

        variants = {f"unfused (torch team of {torch.get_num_threads()})": (unfused, 1)}
        for n in (1, 2, 4):
            variants[f"fused, {n} worker(s)"] = (lambda n=n, g=g1, o=o1: fused.fused_update(o, g, [0.5], threads=n), 1)
        variants["2 layers at once, cores split"] = (two_at_once, 2)
        variants["2 layers one after the other"] = (one_after_other, 2)
        ratios: dict[str, list[float]] = {k: [] for k in variants}
        for r in range(a.reps + 1):
            for label, (fn, layers) in variants.items():
                bw = copy_bandwidth(1 << 24, 2)
                t0 = time.perf_counter()
                fn()
                t = time.perf_counter() - t0
                if r:
                    ratios[label].append(t / (layers * a.numel * per / bw))
        for label, xs in ratios.items():
            rows.append({"layer": master.value, "variant": label, "cores": cores,
                         "x_bound_best": round(min(xs), 2), "x_bound_median": round(statistics.median(xs), 2)})
            print(rows[-1], flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "threads.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
