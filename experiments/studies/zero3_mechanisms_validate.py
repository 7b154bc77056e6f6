"""Fit the ZeRO-3 mechanism constants from `results/zero3_mechanisms/` and check the planner's ZeRO-3
model against real DeepSpeed runs it was not fitted on.

    python -m experiments.studies.zero3_mechanisms_validate [--mechanisms results/zero3_mechanisms] [--sweep results/quick]

- **Fit** (`fit.json`), each a physical constant of this host, from the microbenchmarks only:
  the per-submodule hook cost (fetch + release, least squares over K and d of per-call time against
  the bytes fetched), the per-parameter gradient hook (runs whose bucket never fills), the bucket
  flush (fixed + per element, runs where every parameter fills a bucket) and DeepSpeedCPUAdam's
  parameters/s on a DRAM-resident (largest) tensor.
- **Held-out check** (`cpu_validation.csv`): every zero3 point of the quick sweep (real DeepSpeed
  through the harness, 1 thread) against the planner with the fitted constants. The `cpu` profile's
  compute rate was benched on another CPU with 2 threads, so the model's compute is taken from the
  same sweep (plain PyTorch's forward + backward at the same shape, same model, same thread count)
  and the planner supplies everything ZeRO-3 adds to it: hooks, fetches, gradient buckets and
  DeepSpeedCPUAdam, each from the microbenchmark constants. The check is on those additions.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parents[2]


def _lstsq(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    a = np.vstack([np.ones_like(x), x]).T
    (c0, c1), *_ = np.linalg.lstsq(a, y, rcond=None)
    return float(c0), float(c1)


def fit_constants(hooks: pd.DataFrame, adam: pd.DataFrame, hf: pd.DataFrame) -> dict[str, Any]:
    """Per-call host costs of DeepSpeed's hooks and DeepSpeedCPUAdam's rate, from the microbenchmarks.

    The per-module hook cost comes from the HF decoders (hf): the per-layer slope of the forward
    time ZeRO-3 adds over plain PyTorch, over the modules per layer. The forward has no gradient
    hooks and, at hidden 64, next to no bytes, so the slope is the four hook closures' Python with
    HF's module inputs and outputs; the Linear stacks' coordinator timers alone miss that part."""
    flushing = hooks[hooks["reduce_bucket"] <= hooks["module_params"]]
    quiet = hooks[hooks["reduce_bucket"] > hooks["modules"] * hooks["module_params"]]
    if flushing.empty or quiet.empty:
        raise ValueError("hooks.csv needs runs with every parameter filling a bucket and runs whose bucket never "
                         "fills (experiments/studies/zero3_mechanisms.py measures both)")
    # fetch + release of one module in one pass; the containers' calls carry no bytes
    per_module = (hooks["fetch_sub_module_s"] + hooks["release_sub_module_s"]) / hooks["release_sub_module_n"]
    module_bytes = hooks["module_params"] * 4.0  # FP32 runs
    coord_s, s_per_byte = _lstsq(module_bytes.to_numpy(), per_module.to_numpy())
    layers = hf["layers"].to_numpy(dtype=float)
    fwd_slope = _lstsq(layers, (hf["zero3_fwd_s"] - hf["plain_fwd_s"]).to_numpy())[1]
    bwd_slope = _lstsq(layers, (hf["zero3_bwd_s"] - hf["plain_bwd_s"]).to_numpy())[1]
    mods_per_layer = _lstsq(layers, hf["modules"].to_numpy(dtype=float))[1]
    hook_s = fwd_slope / mods_per_layer
    calls = "reduce_independent_p_g_buckets_and_remove_grads"
    per_param_quiet = quiet[f"{calls}_s"] / quiet[f"{calls}_n"]  # bucket add only (copy into the bucket)
    grad_hook_s, grad_hook_elem_s = _lstsq(quiet["module_params"].to_numpy(dtype=float), per_param_quiet.to_numpy())
    n = flushing["module_params"].to_numpy(dtype=float)
    per_flush = (flushing[f"{calls}_s"] / flushing[f"{calls}_n"]).to_numpy() - (grad_hook_s + grad_hook_elem_s * n)
    flush_s, flush_elem_s = _lstsq(n, per_flush)
    # DeepSpeedCPUAdam on the largest (DRAM-resident) tensor, median over every run recorded
    big = adam[adam["params"] == adam["params"].max()]
    return {
        "zero3_module_hook_s": max(hook_s, 0.0),
        "hf_forward_added_per_layer_s": fwd_slope,
        "hf_backward_added_per_layer_s": bwd_slope,
        "hf_modules_per_layer": mods_per_layer,
        "coordinator_fetch_release_per_module_s": coord_s,
        "fetch_effective_gbs": (1.0 / s_per_byte / 1e9) if s_per_byte > 0 else None,
        "zero3_param_grad_hook_s": max(grad_hook_s, 0.0),
        "zero3_bucket_flush_s": max(flush_s, 0.0),
        # per gradient element: the copy into the bucket at every hook, plus the flush's own work
        "zero3_grad_elem_s": max(grad_hook_elem_s, 0.0) + max(flush_elem_s, 0.0),
        "cpu_adam_params_per_s": float(big["deepspeed_cpu_adam_params_per_s"].median()),
        "cpu_adam_params_per_s_runs": [float(x) for x in big["deepspeed_cpu_adam_params_per_s"]],
        "cpu_adam_params": int(big["params"].iloc[0]),
        "torch_fused_adamw_params_per_s": float(big["torch_fused_adamw_params_per_s"].median()),
        "threads": int(hooks["threads"].iloc[0]),
    }


def validate_cpu(sweep: pd.DataFrame, constants: dict[str, Any]) -> pd.DataFrame:
    """zero3 / torch step-time ratio, measured vs the planner with the fitted constants."""
    from megatrain.planner import get_hardware, plan

    fields = ("zero3_module_hook_s", "zero3_param_grad_hook_s", "zero3_bucket_flush_s", "zero3_grad_elem_s",
              "cpu_adam_params_per_s")
    hw = get_hardware("cpu").with_(**{k: constants[k] for k in fields})
    ok = sweep[sweep["status"] == "ok"]
    rows = []
    for _, z in ok[ok["backend"] == "zero3"].iterrows():
        key = (z["model"], z["seq_len"], z["micro_batch"], z["grad_accum"])
        t = ok[(ok["backend"] == "torch") & (ok["model"] == key[0]) & (ok["seq_len"] == key[1])
               & (ok["micro_batch"] == key[2]) & (ok["grad_accum"] == key[3])]
        if t.empty:
            continue
        kw = dict(grad_accum=int(key[3]), dtype="float32", hardware=hw)
        pz = plan(key[0], int(key[1]), int(key[2]), backend="zero3", **kw)
        pt = plan(key[0], int(key[1]), int(key[2]), backend="torch", **kw)
        tr = t.iloc[0]
        # the model's compute, measured: torch's forward + backward at the same shape and thread count
        compute = tr["forward_s"] + tr["backward_s"]
        extras = pz.time.step_s - pz.time.busy_s["compute"]  # all ZeRO-3 adds (serial on a CPU device)
        predicted = compute + extras
        rows.append({"label": z["label"], "measured_zero3_s": z["step_time_s"],
                     "measured_torch_fwd_bwd_s": compute, "predicted_zero3_extras_s": extras,
                     "predicted_zero3_s": predicted, "error_pct": 100 * (predicted / z["step_time_s"] - 1),
                     "measured_fwd_s": z["forward_s"], "measured_bwd_s": z["backward_s"],
                     "measured_opt_s": z["optimizer_s"], "predicted_opt_s": pz.time.optimizer_s,
                     "predicted_hooks_s": pz.time.busy_s.get("host hooks"),
                     "predicted_fetch_s": pz.time.busy_s["link h2d"],
                     "planner_only_zero3_s": pz.time.step_s, "planner_only_torch_s": pt.time.step_s,
                     "sweep_commit": z["git_commit"]})
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mechanisms", default=str(REPO / "results" / "zero3_mechanisms"))
    ap.add_argument("--sweep", default=str(REPO / "results" / "quick"))
    args = ap.parse_args(argv)
    from megatrain.metrics.provenance import git_commit

    mech = Path(args.mechanisms)
    hooks, hf = pd.read_csv(mech / "hooks.csv"), pd.read_csv(mech / "hf_layers.csv")
    adam = pd.concat([pd.read_csv(f) for f in sorted(mech.glob("cpu_adam*.csv"))], ignore_index=True)
    constants = fit_constants(hooks, adam, hf)
    commit, dirty = git_commit()
    constants.update({"fitted_from": sorted(f.name for f in mech.glob("*.csv") if f.name != "cpu_validation.csv"),
                      "measured_commit": str(hooks["git_commit"].iloc[0]), "cpu_model": str(hooks["cpu_model"].iloc[0]),
                      "versions": str(hooks["versions"].iloc[0]), "git_commit": commit, "git_dirty": dirty})
    (mech / "fit.json").write_text(json.dumps(constants, indent=1) + "\n")
    print(json.dumps(constants, indent=1))
    val = validate_cpu(pd.read_csv(Path(args.sweep) / "results.csv"), constants)
    val["git_commit"], val["git_dirty"] = commit, dirty
    val.to_csv(mech / "cpu_validation.csv", index=False)
    print(val.to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
