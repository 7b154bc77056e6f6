"""Experiment harness: sweep specs, an isolated per-point runner, crash-safe results and reports.

`studies/` holds the one-off scripts behind each `results/` folder; `gpu_check/` the check of the CUDA path.
"""
