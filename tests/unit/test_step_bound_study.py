"""The step-bound study's table: each variant planned at each point, the torch reference shared, the CSV written."""

from __future__ import annotations

import csv

from experiments.studies import step_bound


def test_each_variant_is_planned_at_each_point(tmp_path):
    rows = step_bound.table(("qwen2.5-32b",), ("h200-pcie",), (4,), label="here")  # most layers host-updated
    assert [r["variant"] for r in rows] == list(step_bound.VARIANTS)
    defaults, serial = rows
    # the same compute model prices plain PyTorch once for the point
    assert defaults["torch_tflops"] == serial["torch_tflops"] > 0
    assert defaults["vs_torch"] == round(defaults["model_tflops"] / defaults["torch_tflops"], 3)
    # the variant reaches the planner: without the speculative step the host's layer updates run after backward
    assert serial["step_ms"] != defaults["step_ms"]
    assert "speculative" not in serial["idle_cause"]
    path = step_bound.write(rows, tmp_path, "here")
    assert path.name == "step_bound_here.csv"
    with open(path) as f:
        assert [(r["label"], r["variant"]) for r in csv.DictReader(f)] == [("here", v) for v in step_bound.VARIANTS]
    assert (tmp_path / "published.csv").exists()
