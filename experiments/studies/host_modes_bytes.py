"""Measured host bytes per parameter of each host-memory mode (a benchmark, not a test).

    python -m experiments.studies.host_modes_bytes [--preset llama-0.6b] [--seq 256] [--steps 3]

Each mode trains `steps` steps on the CPU device in its own process (engine_bench rss: peak RSS growth
over the post-import baseline, so the emulated device's buffers and transients are included) and is set
next to the planner's figure for the same mode (megatrain/costs/modes.py). Writes results/host_modes/bytes-<preset>.json
and bytes-<preset>.md (runs under runs-<preset>/; --resume keeps the modes already there).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from megatrain.costs.modes import GradSlab, HostMaster, layer_bytes_per_param

MODES = [
    ("fp32 master + fp32 grads, FP32 compute (default)", {}),
    ("fp32 master + bf16 shadow + fp32 grads", {"compute_dtype": "bfloat16"}),
    ("hilo + fp32 grads", {"compute_dtype": "bfloat16", "host_master": "hilo"}),
    ("hilo + bf16 grads", {"compute_dtype": "bfloat16", "host_master": "hilo", "host_grad_dtype": "bfloat16"}),
    ("hilo + optimizer in backward", {"compute_dtype": "bfloat16", "host_master": "hilo",
                                      "optimizer_in_backward": True}),
    ("bf16 master + bf16 grads (paper's code)", {"compute_dtype": "bfloat16", "host_master": "bf16",
                                                 "host_grad_dtype": "bfloat16"}),
]


def planned(cfg: dict) -> int:
    return layer_bytes_per_param(HostMaster(cfg.get("host_master", "fp32")),
                                 GradSlab(cfg.get("host_grad_dtype", "float32")),
                                 cfg.get("optimizer_in_backward", False), cfg.get("compute_dtype") == "bfloat16")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-0.6b")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="results/host_modes")
    ap.add_argument("--resume", action="store_true", help="keep the modes already measured under OUT/runs")
    a = ap.parse_args()
    out = Path(a.out)
    tmp = out / f"runs-{a.preset}"
    rows = []
    for i, (label, cfg) in enumerate(MODES):
        if (tmp / f"mode{i}.json").is_file() and a.resume:
            print(f"{label}: kept {tmp / f'mode{i}.json'}", flush=True)
        else:
            subprocess.run([sys.executable, "-m", "experiments.studies.engine_bench", "rss", "--preset", a.preset,
                            "--seq", str(a.seq), "--steps", str(a.steps), "--engine", json.dumps(cfg),
                            "--out", str(tmp), "--name", f"mode{i}"], check=True, stdout=subprocess.DEVNULL)
        r = json.loads((tmp / f"mode{i}.json").read_text())
        rows.append({"mode": label, "engine": cfg, "planned_layer_bytes_per_param": planned(cfg),
                     "store_bytes_per_param": r["host_store_bytes_per_param"],
                     "peak_rss_growth_bytes_per_param": r["bytes_per_param"], "params": r["params"],
                     "step_s": r["step_s"], "provenance": r["provenance"]})
    (out / f"bytes-{a.preset}.json").write_text(json.dumps(rows, indent=2))
    lines = [f"Host bytes per parameter, {a.preset} ({rows[0]['params'] / 1e6:.0f}M params), CPU device, "
             f"seq {a.seq}, {a.steps} steps", "",
             "| mode | planner (layers: master + shadow + grad + Adam) | store (counted) | peak RSS growth |",
             "|---|---|---|---|"]
    lines += [f"| {r['mode']} | {r['planned_layer_bytes_per_param']} | {r['store_bytes_per_param']:.2f} | "
              f"{r['peak_rss_growth_bytes_per_param']:.2f} |" for r in rows]
    (out / f"bytes-{a.preset}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
