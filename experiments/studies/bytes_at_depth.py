"""Host bytes per parameter at depth: a deep, narrow model per host mode, measured against the planner (a
measurement, not a test).

    python -m experiments.studies.bytes_at_depth [--layers 64] [--hidden 256] [--vocab 2048] [--seq 64] [--steps 2]

Each mode trains `steps` steps on the CPU device in a process of its own; its peak RSS growth over the
post-import baseline (VmHWM, so the model's construction and every step's transients are in it) is set next
to the planner's host total for the same point (megatrain/planner/memory.py's megatrain_memory on the
"cpu" hardware profile: the host parts plus the device parts a CPU device takes from host memory, less the
runtime reserve, which the baseline already holds). At depth the per-layer terms dominate, so the ratio
says whether the per-layer and fixed terms are right. Writes results/bytes_at_depth/bytes-L<layers>.json and
.md with provenance (machine, versions, commit).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from experiments.studies.host_modes_bytes import MODES


def _preset(layers: int, hidden: int, vocab: int):
    from megatrain.models.presets import ModelPreset

    return ModelPreset(f"deep-narrow-{layers}x{hidden}", "llama", layers, hidden, hidden * 11 // 4, 4, 4, vocab, 2048)


def planned(layers: int, hidden: int, vocab: int, seq: int, cfg: dict) -> dict:
    from megatrain.planner.estimate import plan_point
    from megatrain.planner.hardware import get_hardware
    from megatrain.planner.point import Point

    p = Point(_preset(layers, hidden, vocab), seq, dtype=cfg.get("compute_dtype", "float32"),
              master=cfg.get("host_master", "fp32"), host_grad_dtype=cfg.get("host_grad_dtype", "float32"),
              optimizer_in_backward=cfg.get("optimizer_in_backward", False), grad_clip=False)
    plan = plan_point(p, get_hardware("cpu"))
    mem = plan.memory
    total = mem.host_total_incl_device - mem.host.get("runtime", 0)
    return {"bytes": int(total), "host": mem.host, "device": mem.device, "shared": mem.shared}


def measure(layers: int, hidden: int, vocab: int, seq: int, steps: int, cfg: dict) -> dict:
    """One mode in this process (run by main in a child of its own)."""
    import time

    import transformers

    from experiments.studies.engine_bench import _batch, _provenance, _rss_now_bytes
    from megatrain.config import EngineConfig
    from megatrain.engine import Engine
    from megatrain.metrics.samplers import peak_rss_bytes

    base = _rss_now_bytes()
    model = transformers.AutoModelForCausalLM.from_config(_preset(layers, hidden, vocab).hf_config())
    eng = Engine(model, EngineConfig(device="cpu", **cfg))
    del model
    n = sum(g.numel for g in eng.store.groups())
    batch = _batch(vocab, 1, seq)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.backward(eng(**batch).loss)
        eng.step()
        eng.zero_grad()
        times.append(time.perf_counter() - t0)
    eng.synchronize()
    return {"params": n, "peak_rss_growth_bytes": peak_rss_bytes() - base, "store_bytes": eng.store.host_bytes(),
            "step_s": times, "provenance": _provenance()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default="results/bytes_at_depth")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # child: the engine settings of one mode, as JSON
    a = ap.parse_args()
    if a.one is not None:
        print(json.dumps(measure(a.layers, a.hidden, a.vocab, a.seq, a.steps, json.loads(a.one))))
        return
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for label, cfg in MODES:
        args = [sys.executable, "-m", "experiments.studies.bytes_at_depth", "--layers", str(a.layers), "--hidden",
                str(a.hidden), "--vocab", str(a.vocab), "--seq", str(a.seq), "--steps", str(a.steps),
                "--one", json.dumps(cfg)]
        r = json.loads(subprocess.run(args, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
        plan = planned(a.layers, a.hidden, a.vocab, a.seq, cfg)
        n = r["params"]
        rows.append({"mode": label, "engine": cfg, "layers": a.layers, "params": n,
                     "measured_bytes_per_param": r["peak_rss_growth_bytes"] / n,
                     "planned_bytes_per_param": plan["bytes"] / n,
                     "ratio": r["peak_rss_growth_bytes"] / plan["bytes"],
                     "store_bytes_per_param": r["store_bytes"] / n, "planned_parts": plan,
                     "step_s": r["step_s"], "provenance": r["provenance"]})
        print(f"{label}: measured {rows[-1]['measured_bytes_per_param']:.2f} B/param, planned "
              f"{rows[-1]['planned_bytes_per_param']:.2f} (ratio {rows[-1]['ratio']:.3f})", flush=True)
    stem = f"bytes-L{a.layers}"
    (out / f"{stem}.json").write_text(json.dumps(rows, indent=2))
    prov = rows[0]["provenance"]
    lines = [f"Host bytes per parameter at depth: {a.layers} layers x hidden {a.hidden}, vocab {a.vocab} "
             f"({rows[0]['params'] / 1e6:.1f}M params), CPU device, seq {a.seq}, {a.steps} steps", "",
             f"Provenance: {json.dumps(prov)}", "",
             "| mode | measured peak RSS growth (B/param) | planner (B/param) | measured / planned |",
             "|---|---|---|---|"]
    lines += [f"| {r['mode']} | {r['measured_bytes_per_param']:.2f} | {r['planned_bytes_per_param']:.2f} | "
              f"{r['ratio']:.3f} |" for r in rows]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
