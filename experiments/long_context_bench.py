"""Long-context benchmark: the longest sequence each backend can train llama-100m on within one memory budget.

    python -m experiments.long_context_bench [--budget-gib 3.0] [--lengths 1024,2048,...] [--backends ...]

Each (backend, length) is two training steps (forward, backward, AdamW; the second timed) of the project's sweep point
(`python -m experiments.point`), in its own process, so every backend runs exactly as a user would run
it. The budget is the peak resident set size (RSS) of that process: on a machine without a GPU the
"device" is host memory, so the budget covers everything (weights, optimizer state, activations). A
watchdog kills a point as soon as its RSS passes the budget (an out-of-memory, as on a GPU), and the
kernel's exact high-water mark (`wait4` ru_maxrss) decides whether a finished point stayed within it.
Lengths are tried in increasing order and a backend stops at its first point over budget.

Writes results/long_context/results.csv and a README.md with the machine, versions, commit and summary.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from experiments.runner import _child_env
from experiments.spec import Point
from megatrain.metrics.device import device_peak_tflops
from megatrain.metrics.link import link_peak_gbps
from megatrain.metrics.provenance import provenance
from megatrain.models.presets import get_preset

REPO = Path(__file__).resolve().parent.parent
FIELDS = ["backend", "seq_len", "fits", "status", "reason", "peak_rss_bytes", "budget_bytes", "tokens_per_s",
          "step_time_s", "forward_s", "backward_s", "optimizer_s", "model_tflops", "peak_device_bytes",
          "device_mem_source", "wall_s"]


def run_point(model: str, backend: str, seq: int, max_pos: int, budget: int, timeout_s: float,
              log_dir: Path) -> dict[str, Any]:
    engine = {"measure_device_memory": True} if backend == "megatrain" else {}
    # One warm-up step first: AdamW allocates its state on the first step, so only the second step's
    # peak is what training at this length holds (and its time is free of first-step allocations).
    pt = Point(backend=backend, model=model, seq_len=seq, micro_batch=1, warmup=1, steps=1, engine=engine,
               max_positions=max_pos, timeout_s=timeout_s)
    result = Path(tempfile.mkdtemp(prefix="lcbench-")) / "row.json"
    log = (log_dir / f"{backend}-{seq}.log").open("w")
    cmd = [sys.executable, "-m", "experiments.point", "--point", json.dumps(pt.to_dict()), "--result", str(result),
           "--parent-pid", str(os.getpid())]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=_child_env(pt), stdout=log, stderr=subprocess.STDOUT)
    watched = psutil.Process(proc.pid)
    status, killed_rss = None, 0
    while True:
        pid, code, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        try:
            rss = watched.memory_info().rss
        except psutil.NoSuchProcess:
            rss = 0
        if rss > budget and status is None:
            status, killed_rss = "over_budget", rss
            os.kill(proc.pid, signal.SIGKILL)
        elif time.perf_counter() - t0 > timeout_s and status is None:
            status = "timeout"
            os.kill(proc.pid, signal.SIGKILL)
        time.sleep(0.05)
    proc.returncode = code  # reaped by wait4 above
    log.close()
    peak = max(usage.ru_maxrss * 1024, killed_rss)  # Linux reports ru_maxrss in KiB
    row: dict[str, Any] = json.loads(result.read_text()) if result.exists() else {}
    if status is None:
        status = "over_budget" if peak > budget else row.get("status", "failed")
    reason = {"over_budget": f"peak RSS {peak / 2**30:.2f} GiB > budget {budget / 2**30:.2f} GiB",
              "timeout": f"no result within {timeout_s:.0f} s"}.get(status, row.get("reason", ""))
    out = {"backend": backend, "seq_len": seq, "fits": status == "ok", "status": status, "reason": reason,
           "peak_rss_bytes": peak, "budget_bytes": budget, "wall_s": round(time.perf_counter() - t0, 1)}
    if status == "ok":
        out.update({k: row.get(k) for k in FIELDS if k in row and k not in out})
    return out


def summarize(rows: list[dict[str, Any]], backends: list[str], lengths: list[int]) -> dict[str, Any]:
    longest = {}
    for b in backends:
        ok = [r["seq_len"] for r in rows if r["backend"] == b and r["fits"]]
        longest[b] = (max(ok) if ok else 0, bool(ok) and max(ok) == max(lengths))
    return longest


def write_readme(out: Path, rows: list[dict[str, Any]], longest: dict, budget: int, args: argparse.Namespace,
                 prov: dict[str, Any], wall: float) -> None:
    lines = [
        "# Long-context benchmark (CPU)",
        "",
        f"The longest sequence each backend trains `{args.model}` ({get_preset(args.model).param_count() / 1e6:.0f}M "
        "parameters, FP32, micro-batch 1; two training steps of forward, backward, AdamW, so the optimizer state "
        "exists during the measured step) on within one memory budget, and tokens/s at each length.",
        "",
        f"- **Budget: peak RSS of the training process <= {budget / 2**30:.2f} GiB.** On this machine there is "
        "no GPU, so the device is host memory and the budget covers everything the process holds (weights, "
        "optimizer state, activations). A watchdog kills a point when its RSS passes the budget; the "
        "kernel's exact high-water mark (wait4 ru_maxrss) decides for finished points.",
        "- Each point is `python -m experiments.point` (the sweep harness) in its own process: torch and zero3 "
        "with HF gradient checkpointing, megatrain with its defaults (per-layer recompute, chunked loss, "
        "`mlp_tile_tokens=\"auto\"`, `offload_activations=\"auto\"`, which on a CPU with no device budget "
        "keeps activations resident: offloading cannot lower RSS when the device is the host) plus "
        "`measure_device_memory=True`, whose `peak_device_bytes` is what a GPU would hold.",
        "- tokens/s is from the second step alone, on a shared 2-core machine that other jobs were loading: "
        "compare backends within a length, not across runs.",
        f"- Lengths tried: {', '.join(map(str, args.lengths))}; a backend stops at its first point over budget. "
        f"Whole run: {wall / 60:.1f} min.",
        "",
        "## Longest sequence within the budget",
        "",
        "| backend | longest fitting length | first length over budget |",
        "| --- | --- | --- |",
    ]
    for b, (n, capped) in longest.items():
        over = next((r for r in rows if r["backend"] == b and not r["fits"]), None)
        first_over = f"{over['seq_len']} ({over['status']}: {over['reason']})" if over else "none tried"
        shown = f">= {n} (longest tried)" if capped else str(n)
        lines.append(f"| {b} | {shown} | {first_over} |")
    mt = longest.get("megatrain", (0, False))[0]
    for other in ("torch", "zero3"):
        if other in longest:
            n = longest[other][0]
            ratio = f"{mt / n:.1f}x" if n else "unbounded (it fits no length tried)"
            lines.append(f"\nmegatrain / {other}: {ratio}" + (" (a lower bound: megatrain reached the longest "
                                                                   "length tried)" if longest['megatrain'][1] else ""))
    lines += ["", "## All points", "", "| backend | seq_len | status | peak RSS GiB | tokens/s | step s | "
              "device GiB (megatrain's accounting) |", "| --- | --- | --- | --- | --- | --- | --- |"]

    def fmt(v: Any, spec: str, scale: float = 1.0) -> str:
        return "" if v is None else format(v / scale, spec)

    for r in rows:
        lines.append(f"| {r['backend']} | {r['seq_len']} | {r['status']} | {fmt(r['peak_rss_bytes'], '.2f', 2**30)} | "
                     f"{fmt(r.get('tokens_per_s'), '.1f')} | {fmt(r.get('step_time_s'), '.1f')} | "
                     f"{fmt(r.get('peak_device_bytes'), '.2f', 2**30)} |")
    lines += ["", "## Provenance", ""]
    lines += [f"- {k}: {v}" for k, v in prov.items()]
    lines += ["", f"Reproduce: `python -m experiments.long_context_bench --model {args.model} --budget-gib "
              f"{args.budget_gib} --lengths {','.join(map(str, args.lengths))} --backends {','.join(args.backends)}`", ""]
    (out / "README.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.long_context_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-100m", help="model preset")
    ap.add_argument("--budget-gib", type=float, default=3.0, help="peak RSS budget per training process")
    ap.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1024, 2048, 3072, 4096, 6144, 8192, 12288])
    ap.add_argument("--backends", type=lambda s: s.split(","), default=["megatrain", "torch", "zero3"])
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="per point")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "long_context")
    args = ap.parse_args(argv)
    budget = int(args.budget_gib * 2**30)
    args.out.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="lcbench-logs-"))
    print(f"point logs: {log_dir}", flush=True)
    prov = provenance()
    # The harness measures the device and link peaks once per machine (a 512 MiB memcpy probe) and
    # caches them: do it here, in a cache of this run's own that other jobs cannot clear, so that probe
    # never lands inside a point's RSS.
    os.environ["MEGATRAIN_CACHE"] = tempfile.mkdtemp(prefix="lcbench-cache-")
    device_peak_tflops("cpu", "fp32")
    link_peak_gbps("cpu")
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for backend in args.backends:
        for seq in sorted(args.lengths):
            r = run_point(args.model, backend, seq, max(args.lengths), budget, args.timeout_s, log_dir)
            rows.append(r)
            print(f"{backend:9s} {seq:6d} {r['status']:11s} peak RSS {r['peak_rss_bytes'] / 2**30:5.2f} GiB "
                  f"{(r.get('tokens_per_s') or 0):7.1f} tok/s  ({r['wall_s']:.0f} s)", flush=True)
            with (args.out / "results.csv").open("w", newline="") as f:  # rewritten after every point
                w = csv.DictWriter(f, FIELDS)
                w.writeheader()
                w.writerows({k: x.get(k) for k in FIELDS} for x in rows)
            if not r["fits"]:
                break  # memory grows with length: longer ones cannot fit either
    longest = summarize(rows, args.backends, args.lengths)
    write_readme(args.out, rows, longest, budget, args, prov, time.perf_counter() - t0)
    print(json.dumps({b: v[0] for b, v in longest.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
