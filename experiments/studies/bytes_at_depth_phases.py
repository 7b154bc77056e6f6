"""Where the host bytes of a per-layer mode grow, phase by phase, at two depths (a measurement, not a test).

    python -m experiments.studies.bytes_at_depth_phases --layers 8 56 [--thresholds 0 65536]

For each depth, glibc mmap threshold (0: glibc's dynamic default) and mode (hilo + the optimizer in backward;
hilo + bf16 slabs), a process of its own builds the bytes-at-depth Llama (bytes_at_depth.py's preset), trains
two steps on the CPU device and reports its RSS over the post-import baseline after placement, after each
step and after a malloc_trim (what glibc held of freed memory), and the Adam state's bytes. The per-layer slope between the two depths, per parameter, is set next to the
planner's per-layer bytes (master + slab + Adam m, v); the difference times the parameters of one layer is
what each layer costs beyond its parameters' bytes. Writes results/bytes_at_depth/phases-h<hidden>.json with
provenance.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

MODES = {"hilo_in_backward": {"compute_dtype": "bfloat16", "host_master": "hilo", "optimizer_in_backward": True},
         "hilo_bf16_grads": {"compute_dtype": "bfloat16", "host_master": "hilo", "host_grad_dtype": "bfloat16"}}
PLANNED_B_PER_PARAM = {"hilo_in_backward": 4 + 8, "hilo_bf16_grads": 4 + 2 + 8}  # costs/modes.py per layer param


def one(layers: int, threshold: int, cfg: dict, hidden: int = 256) -> dict:
    """One point in this process (main runs each in a child of its own)."""
    import torch
    import transformers

    from experiments.studies.bytes_at_depth import _preset
    from experiments.studies.engine_bench import _batch, _rss_now_bytes, timed_steps
    from megatrain.config.schema import EngineConfig
    from megatrain.engine import Engine

    torch.set_num_threads(1)
    base = _rss_now_bytes()
    model = transformers.AutoModelForCausalLM.from_config(_preset(layers, hidden, 2048).hf_config())
    extra = {"host_mmap_threshold_bytes": threshold} if threshold else {}
    eng = Engine(model, EngineConfig(device="cpu", parity_probe=False, **cfg, **extra))
    del model
    out = {"placed": _rss_now_bytes() - base}
    batch = _batch(2048, 1, 64)
    for s in range(2):
        timed_steps(eng, batch, 1)
        eng.synchronize()
        out[f"step{s + 1}"] = _rss_now_bytes() - base
    from megatrain.engine.parts import release_free_heap

    release_free_heap()  # what of the growth is freed memory glibc keeps (returned by malloc_trim)
    out["trimmed"] = _rss_now_bytes() - base
    out["adam"] = sum(t.numel() * t.element_size() for st in eng.optimizer.state.values() for t in st.values()
                      if torch.is_tensor(t) and t.dim() > 0)
    out["layer_params"] = sum(g.numel for g in eng.store.layers)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs=2, default=[8, 56])
    ap.add_argument("--thresholds", type=int, nargs="+", default=[0, 65536])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--out", default="results/bytes_at_depth")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one is not None:
        print(json.dumps(one(*json.loads(a.one))))  # [layers, threshold, cfg, hidden]
        return
    from megatrain.metrics.provenance import provenance

    rows = []
    for name, cfg in ((m, MODES[m]) for m in a.modes):
        for threshold in a.thresholds:
            pts = []
            for layers in a.layers:
                cmd = [sys.executable, "-m", "experiments.studies.bytes_at_depth_phases", "--one",
                       json.dumps([layers, threshold, cfg, a.hidden])]
                pts.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True)
                                      .stdout.strip().splitlines()[-1]))
            dn = pts[1]["layer_params"] - pts[0]["layer_params"]
            slope = {k: (pts[1][k] - pts[0][k]) / dn for k in ("placed", "step1", "step2", "trimmed", "adam")
                     if k in pts[0] and k in pts[1]}
            per_layer_params = dn / (a.layers[1] - a.layers[0])
            row = {"mode": name, "mmap_threshold": threshold or "dynamic", "layers": a.layers, "hidden": a.hidden,
                   "points": pts,
                   "slope_b_per_param": slope, "planned_b_per_param": PLANNED_B_PER_PARAM[name],
                   "ratio": slope["step2"] / PLANNED_B_PER_PARAM[name], "params_per_layer": per_layer_params,
                   "bytes_per_layer_beyond_params": (slope["step2"] - PLANNED_B_PER_PARAM[name]) * per_layer_params}
            rows.append(row)
            print(f"{name:18s} threshold {row['mmap_threshold']!s:8s} placed {slope['placed']:.2f} step1 "
                  f"{slope['step1']:.2f} step2 {slope['step2']:.2f} adam {slope['adam']:.2f} B/param -> x{row['ratio']:.3f} "
                  f"({row['bytes_per_layer_beyond_params'] / 1024:.0f} KiB per layer)", flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"phases-h{a.hidden}.json").write_text(json.dumps({"rows": rows, "provenance": provenance("cpu")}, indent=1))
    print(f"-> {out / f'phases-h{a.hidden}.json'}")


if __name__ == "__main__":
    main()
