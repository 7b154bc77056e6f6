"""The step-bound study's table: both variants planned at each point, the torch reference shared, the CSV written."""

from __future__ import annotations

import csv

from experiments.studies import step_bound


def test_before_and_after_are_planned_at_each_point(tmp_path):
    rows = step_bound.table(("llama2-7b",), ("h200-pcie",), (4,))
    before, after = rows
    assert (before["variant"], after["variant"]) == ("before", "after")
    # the same compute model prices plain PyTorch once for the point
    assert before["torch_tflops"] == after["torch_tflops"] > 0
    # "before" is the step without the speculative update: its layer updates wait behind the next forward
    assert before["idle_cause"] == "layer updates not hidden behind the next forward"
    assert after["step_ms"] < before["step_ms"]
    path = step_bound.write(rows, tmp_path)
    with open(path) as f:
        assert [r["variant"] for r in csv.DictReader(f)] == ["before", "after"]
    assert (tmp_path / "published.csv").exists()
