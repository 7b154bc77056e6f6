"""One traced training step on this machine, for the per-step timeline figure.

    python -m experiments.studies.timeline [--model small-7m] [--context 256] [--gbps 0.05] [--out results/timeline]

The engine runs on the CPU with its copy engine rate-limited to an emulated link (`link_gbps`) and
`EngineConfig(trace=True)`: every per-layer span on the compute stream (forward, recomputing backward)
and on the two copy streams (weight loads, gradient copies, activation offload) is recorded
(engine/stream.py `Trace`). After a warm-up step, one step's records go to OUT/trace.json with
provenance and, for comparison, the planner's predicted timeline of the same step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def traced_step(model: str, context: int, gbps: float | None, offload: bool, seed: int = 0) -> dict[str, Any]:
    """Records of the second of two steps (the first warms up), times relative to its start."""
    import torch

    from experiments.studies.validation import build_model
    from megatrain.config import EngineConfig
    from megatrain.engine import Engine
    from megatrain.planner.shapes import resolve_model

    preset = resolve_model(model)
    cfg = EngineConfig(device="cpu", link_gbps=gbps, trace=True, offload_activations=offload)
    eng = Engine(build_model(preset, seed), config=cfg)
    x = torch.randint(0, preset.vocab, (1, context), generator=torch.Generator().manual_seed(seed + 1))
    for _ in range(2):
        eng.reset_stats()  # clears the trace too: the records kept are the last step's
        t0 = eng.trace_log.now()
        wall = time.perf_counter()
        out = eng(input_ids=x, labels=x)
        eng.backward(out.loss)
        eng.step()
        eng.zero_grad()
        stats = eng.collect_stats()
        step_s = time.perf_counter() - wall
    records = [{"stream": r.stream, "kind": r.kind, "layer": r.layer,
                "start_s": r.t_start - t0, "end_s": r.t_end - t0} for r in eng.trace]
    return {"model": preset.name, "seq_len": context, "link_gbps": gbps, "offload_activations": offload,
            "precision": "fp32", "device": "cpu", "step_s": step_s,
            "stats": {k: float(v) for k, v in stats.items()}, "records": records}


def predicted(model: str, context: int, gbps: float | None, offload: bool) -> dict[str, Any]:
    """The planner's timeline of the same step (its pipeline simulation, engine/schedule.py's issue
    order) on this machine's committed 'cpu' profile, in the trace's format."""
    from megatrain.config import EngineConfig
    from megatrain.planner import plan
    from megatrain.planner.estimate import predicted_timeline

    pl = plan(model, context=context, dtype="float32", hardware="cpu",
              engine_config=EngineConfig(device="cpu", link_gbps=gbps, offload_activations=offload))
    return {"hardware": "cpu profile (megatrain/data/hardware.yaml)", "step_s": pl.time.step_s,
            "records": predicted_timeline(pl.point, pl.hardware)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small-7m")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--gbps", type=float, default=0.05, help="emulated link rate; 0 = unthrottled")
    ap.add_argument("--offload-activations", action="store_true")
    ap.add_argument("--out", default="results/timeline")
    args = ap.parse_args(argv)

    from megatrain.metrics.provenance import provenance

    gbps = args.gbps or None
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
