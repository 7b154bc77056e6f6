"""Experiment harness: sweep specs, an isolated per-point runner, crash-safe results and reports."""
