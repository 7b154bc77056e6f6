"""The studies behind `results/`: each script produced one results folder and is named after it.

Run each from the repository root as `python -m experiments.studies.NAME` (its docstring gives the
options). Where one folder holds several measurements, their scripts share its name as a prefix.

| script | writes |
| --- | --- |
| `compat` | `results/compat/compat.csv` and `docs/COMPATIBILITY.md` |
| `engine_bench` | `results/engine_bench/` (`rss`, `ratio`, `overlap`) |
| `host_modes_bytes`, `host_modes_study` | `results/host_modes/` (bytes per parameter; loss curves) |
| `long_context` | `results/long_context/<model>[-<budget>]/` |
| `published` | `results/published/published.csv` |
| `scaling`, `scaling_host_memory` (+ its `_worker`) | `results/scaling/` (`measured.csv`, `predicted.csv`; `host_memory.csv`) |
| `soak` | `results/soak/result.json` |
| `timeline` | `results/timeline/trace.json` |
| `validation` | `results/validation/` |
| `zero3_mechanisms`, `zero3_mechanisms_validate` | `results/zero3_mechanisms/` (microbenchmarks; `fit.json`, `cpu_validation.csv`) |

The sweep harness (`experiments/spec.py`, `runner.py`, `execute.py`, `point.py`, `results.py`, `report.py`,
`executors/`) is the product these build on; `results/quick` and `results/zero3_tuning` come from it
(`megatrain sweep experiments/sweeps/<name>.yaml`), not from a study.
"""
