"""The benchmarks moved to megatrain/metrics/bench.py; `bench` is named here for commands/plan.py's import."""

from ..metrics.bench import bench  # noqa: F401 - kept until plan.py imports metrics.bench: remove then
