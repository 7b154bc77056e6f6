"""One traced training step on this machine, for the per-step timeline figure.

    python -m experiments.studies.timeline [--model small-7m] [--context 256] [--gbps 0.05] [--out results/timeline]
    python -m experiments.studies.timeline --validate [--model small-7m] [--context 128] [--gbps 0.005,0.01,0.02]

The engine runs on the CPU with its copy engine rate-limited to an emulated link (`link_gbps`) and
`EngineConfig(trace=True)`: every per-layer span on the compute stream (forward, recomputing backward)
and on the two copy streams (weight loads, gradient copies, activation offload) is recorded
(engine/runtime/stream.py `Trace`). After a warm-up step, one step's records go to OUT/trace.json with
provenance and, for comparison, the planner's predicted timeline of the same step.

--validate sets the planner's step timeline (`megatrain plan`'s "step timeline": GPU busy, each link's busy time,
the GPU idle fraction; planner/step_timeline.py) against the engine's own, per emulated link rate, median of
--steps traced steps: the step's wall time (host work it causes drained inside the clock), the compute thread's
busy time (the engine's forward and backward phase clocks less its copy waits: the layers' traced spans and the
head's work between them), each copy stream's busy time from the trace, and GPU idle = 1 - busy / step. The
planner plans against the committed "cpu" profile with the emulated link, or with --fit against a profile measured
in the same run as experiments/studies/validation.py measures it (bench_cpu's rates, the compute rate and fixed
costs fitted to engine steps of the same model at other token counts than the validated one); nothing is fitted to
the validated points. Rows go to OUT/timeline_validation.csv with provenance.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def traced_step(model: Any, context: int, gbps: float | None, offload: bool, seed: int = 0,
                steps: int = 2) -> dict[str, Any]:
    """Records of the last of `steps` steps (the first warms up), times relative to its start; with every
    step's wall time and stats."""
    import torch

    from experiments.studies.validation import build_model
    from megatrain.config.schema import EngineConfig
    from megatrain.engine import Engine
    from megatrain.planner import resolve_model

    preset = resolve_model(model)
    cfg = EngineConfig(device="cpu", link_gbps=gbps, trace=True, offload_activations=offload, residency="stream")
    eng = Engine(build_model(preset, seed), config=cfg)
    x = torch.randint(0, preset.vocab, (1, context), generator=torch.Generator().manual_seed(seed + 1))
    runs = []
    for _ in range(steps):
        eng.reset_stats()  # clears the trace too: the records kept are the last step's
        t0 = eng.trace_log.now()
        wall = time.perf_counter()
        out = eng(input_ids=x, labels=x)
        eng.backward(out.loss)
        eng.clip_grad_norm_(1.0)  # the planner charges clipping by default (grad_clip=True)
        eng.step()
        eng.zero_grad()
        stats = eng.collect_stats()  # drains what the step queued, inside the clock
        step_s = time.perf_counter() - wall
        records = [{"stream": r.stream, "kind": r.kind, "layer": r.layer,
                    "start_s": r.t_start - t0, "end_s": r.t_end - t0} for r in eng.trace]
        runs.append({"step_s": step_s, "stats": {k: float(v) for k, v in stats.items() if not isinstance(v, str)}, "records": records})
    return {"model": preset.name, "seq_len": context, "link_gbps": gbps, "offload_activations": offload,
            "precision": "fp32", "device": "cpu", **runs[-1], "runs": runs[1:] if steps > 1 else runs}


def predicted(model: Any, context: int, gbps: float | None, offload: bool) -> dict[str, Any]:
    """The planner's timeline of the same step (its pipeline simulation, engine/pipeline/schedule.py's issue
    order) on this machine's committed 'cpu' profile, in the trace's format."""
    from megatrain.config.schema import EngineConfig
    from megatrain.planner import plan, predicted_timeline

    pl = plan(model, context=context, dtype="float32", hardware="cpu",
              engine_config=EngineConfig(device="cpu", link_gbps=gbps, offload_activations=offload,
                                           residency="stream"))
    return {"hardware": "cpu profile (megatrain/data/hardware.yaml)", "step_s": pl.time.step_s,
            "records": predicted_timeline(pl.point, pl.hardware)}


# The target for each quantity of the timeline.
TOL_PCT = 15.0
QUANTITIES = ("step_s", "gpu_busy_s", "gpu_idle_fraction", "h2d_busy_s", "d2h_busy_s")


def measured_timeline(run: dict[str, Any]) -> dict[str, float]:
    """One traced step's timeline: its wall time, the compute thread's busy time, each copy stream's."""
    st = run["stats"]
    busy = {lane: sum(r["end_s"] - r["start_s"] for r in run["records"] if r["stream"] == lane)
            for lane in ("h2d", "d2h")}
    gpu = st["forward_s"] + st["backward_s"] - st["copy_wait_s"]
    return {"step_s": run["step_s"], "gpu_busy_s": gpu, "gpu_idle_fraction": 1 - gpu / run["step_s"],
            "h2d_busy_s": busy["h2d"], "d2h_busy_s": busy["d2h"]}


def predicted_timeline_summary(model: Any, context: int, gbps: float | None, offload: bool,
                               hardware: Any = "cpu") -> dict[str, Any]:
    """The planner's step timeline (what `megatrain plan` prints) for the same step on a CPU profile."""
    from megatrain.config.schema import EngineConfig
    from megatrain.planner import plan

    pl = plan(model, context=context, dtype="float32", hardware=hardware,
              engine_config=EngineConfig(device="cpu", link_gbps=gbps, offload_activations=offload,
                                           residency="stream"))
    tl = pl.timeline
    return {"step_s": tl.step_s, "gpu_busy_s": tl.gpu_busy_s, "gpu_idle_fraction": tl.gpu_idle_fraction,
            "h2d_busy_s": tl.link_busy_s["h2d"], "d2h_busy_s": tl.link_busy_s["d2h"], "idle_cause": tl.idle_cause}


def fitted_profile(model: Any, context: int) -> Any:
    """This machine's profile measured now and fitted to the engine away from the validated context
    (experiments/studies/validation.py's bench and engine fit, torch's default threads as the traced steps)."""
    from experiments.studies.validation import engine_profile, fit_periods_in_child, overhead_tokens
    from megatrain.metrics.bench import bench_cpu
    from megatrain.planner import get_hardware, resolve_model

    preset = resolve_model(model)
    prof = bench_cpu(quick=True, threads=None, engine_fit=False)
    periods = fit_periods_in_child(preset, overhead_tokens(context), None)
    return get_hardware(engine_profile(prof, preset, context, [periods]))


def validate_timeline(model: Any, context: int, gbps: list[float | None], steps: int = 3,
                      offload: bool = False, hardware: Any = "cpu") -> list[dict[str, Any]]:
    """Per link rate: measured (median of `steps` traced steps after a warm-up) and predicted on `hardware` (a CPU
    profile), and the error."""
    import statistics

    rows = []
    for rate in gbps:
        doc = traced_step(model, context, rate, offload, steps=steps + 1)
        ms = [measured_timeline(r) for r in doc["runs"]]
        meas = {k: statistics.median(m[k] for m in ms) for k in QUANTITIES}
        pred = predicted_timeline_summary(model, context, rate, offload, hardware)
        row: dict[str, Any] = {"model": doc["model"], "seq_len": context, "link_gbps": rate,
                               "profile": hardware if isinstance(hardware, str) else "fitted in this run",
                               "predicted_idle_cause": pred["idle_cause"]}
        for k in QUANTITIES:
            row[f"measured_{k}"], row[f"predicted_{k}"] = meas[k], pred[k]
            row[f"error_pct_{k}"] = 100.0 * (pred[k] - meas[k]) / meas[k] if meas[k] else float("nan")
        rows.append(row)
    return rows


def _validate_main(args: argparse.Namespace) -> int:
    import csv

    from experiments.studies.validation import parse_gbps
    from megatrain.metrics.provenance import provenance

    hw = fitted_profile(args.model, args.context) if args.fit else "cpu"
    rows = validate_timeline(args.model, args.context, parse_gbps(args.gbps), args.steps, hardware=hw)
    prov = provenance()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "timeline_validation.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[*rows[0], "loadavg", "git_commit", "git_dirty", "cpu_model", "cpu_count"])
        w.writeheader()
        for r in rows:
            w.writerow({**r, "loadavg": os.getloadavg()[0],
                        **{k: prov[k] for k in ("git_commit", "git_dirty", "cpu_model", "cpu_count")}})
    for r in rows:
        errs = ", ".join(f"{k} {r[f'error_pct_{k}']:+.1f}%" for k in QUANTITIES)
        print(f"{r['link_gbps']} GB/s: idle measured {r['measured_gpu_idle_fraction']:.1%} predicted "
              f"{r['predicted_gpu_idle_fraction']:.1%} ({r['predicted_idle_cause']}); {errs}")
    print(f"-> {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small-7m")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--gbps", default="0.05", help="emulated link rate, GB/s; 0 = unthrottled (--validate: a comma "
                                                   "list, 'none' for unthrottled)")
    ap.add_argument("--offload-activations", action="store_true")
    ap.add_argument("--out", default="results/timeline")
    ap.add_argument("--validate", action="store_true", help="the planner's step timeline against the engine's")
    ap.add_argument("--fit", action="store_true", help="--validate: plan against a profile measured in this run")
    ap.add_argument("--steps", type=int, default=3, help="--validate: traced steps per link rate (after a warm-up)")
    args = ap.parse_args(argv)
    if args.validate:
        return _validate_main(args)

    from megatrain.metrics.provenance import provenance

    gbps = float(args.gbps) or None
    doc = traced_step(args.model, args.context, gbps, args.offload_activations)
    doc["predicted"] = predicted(args.model, args.context, gbps, args.offload_activations)
    doc["source"] = "measured"
    doc["provenance"] = provenance()
    doc["loadavg"] = os.getloadavg()[0]  # a shared box: other work stretches the compute spans
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "trace.json").write_text(json.dumps(doc, indent=1))
    print(f"step {doc['step_s']:.3f} s, {len(doc['records'])} spans -> {out / 'trace.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
