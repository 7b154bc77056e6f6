"""The harness as a new user runs it: from a folder of their own, outside the checkout, with relative paths (the
spec, --out, a model directory named in the spec). Every point runs, and nothing is written outside --out."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pandas as pd
import pytest
from kit import ROOT, run_python
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from experiments import report as report_module
from experiments import results as R
from megatrain.models.presets import get_preset

SPEC = """
name: mine
defaults: {warmup: 0, steps: 1, seq_len: 32, threads: 1, timeout_s: 300}
points:
  - {backend: torch, model: tiny}
  - {backend: megatrain, model: ./mymodel}
"""


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def _checkout_state() -> set[str]:
    """Every changed, untracked or ignored file of the checkout, less Python's byte-code caches (which importing
    a module writes, whoever imports it)."""
    out = subprocess.run(["git", "status", "--porcelain", "--ignored", "--untracked-files=all"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return {line for line in out.splitlines() if "__pycache__" not in line and ".pytest_cache" not in line}


@pytest.fixture(scope="module")
def elsewhere(tmp_path_factory):
    """A sweep of two of the cheapest points run from a folder outside the checkout: its folder, the checkout's
    state before and after, the folder's files before, and the command's result."""
    home = tmp_path_factory.mktemp("user")
    assert ROOT not in home.parents
    (home / "mine.yaml").write_text(SPEC)
    get_preset("tiny").hf_config().save_pretrained(home / "mymodel")  # a model directory, named relatively
    before, files_before = _checkout_state(), _tree(home)
    proc = run_python(["-m", "megatrain.commands.cli", "sweep", "mine.yaml", "--out", "runs/x", "--no-progress"],
                      cwd=home, timeout=600)
    return home, before, _checkout_state(), files_before, proc


def test_a_sweep_from_another_folder_runs_every_point_and_writes_only_under_out(elsewhere):
    home, before, after, files_before, proc = elsewhere
    assert proc.returncode == 0, proc.stderr[-3000:]
    df = R.read_rows(home / "runs" / "x" / "results.csv")
    assert len(df) == 2 and set(df["status"]) == {"ok"}, df[["label", "status", "reason"]].to_string()
    model = df.loc[df["backend"] == "megatrain", "model"].iloc[0]
    assert model == str(home / "mymodel")  # the spec's relative path, resolved where the user ran the sweep
    new = _tree(home) - files_before
    assert new and all(f.startswith("runs/x/") for f in new), sorted(new)
    assert after == before, sorted(after ^ before)  # the checkout untouched


@pytest.mark.slow
def test_report_runs_the_notebook_on_a_sweep_from_another_folder(elsewhere):
    home, _, _, _, sweep = elsewhere
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    before, files_before = _checkout_state(), _tree(home)
    proc = run_python(["-m", "megatrain.commands.cli", "report", "runs/x", "--notebook"], cwd=home, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = home / "runs" / "x"
    assert (out / "report.md").is_file()
    figures = sorted((out / "notebook").glob("*.png"))
    assert len(figures) >= 5 and all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in figures), figures
    executed = json.loads((out / "notebook" / "figures.ipynb").read_text())
    text = "".join("".join(o.get("text", "")) for c in executed["cells"] for o in c.get("outputs", []))
    assert "quick/results.csv not found" not in text  # the sweep's own results.csv is the measured sweep
    assert all(str(p) in proc.stdout for p in figures)
    new = _tree(home) - files_before
    assert new and all(f.startswith("runs/x/") for f in new), sorted(new)
    assert _checkout_state() == before


def _drawn(monkeypatch, draw) -> list[Axes]:
    """The axes a report figure draws, caught as it is saved."""
    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: saved.extend(fig.axes))
    draw(Path("unused.png"))
    return saved


def _rows(sizes: list[float], batches: list[int]) -> pd.DataFrame:
    return pd.DataFrame([{"series": s, "model": f"m{p:g}", "params": p, "seq_len": 32, "micro_batch": b,
                          "grad_accum": 1, "batch": b, "tokens_per_s": t * b / p, "model_tflops": t * 1e-6,
                          "peak_device_bytes": 2.0**30, "peak_host_rss_bytes": 2.0**31}
                         for s, t in (("torch", 100.0), ("megatrain", 80.0)) for p in sizes for b in batches])


def test_a_figure_with_one_x_value_is_bars_not_lines(monkeypatch):
    (ax,) = _drawn(monkeypatch, lambda out: report_module._fig_vs_axis(_rows([1.0], [1]), out, "batch", "x",
                                                                      ["series", "model"], "T (lines: a / b)"))
    assert not ax.lines and sorted(p.get_height() for p in ax.patches) == [80.0, 100.0]
    assert "bars:" in ax.get_title()
    for fig in (report_module._fig_vs_model, report_module._fig_memory):
        axes = _drawn(monkeypatch, lambda out, fig=fig: fig(_rows([1.0], [1]), out))
        assert len(axes) == 2 and all(not ax.lines and len(ax.patches) == 2 for ax in axes), fig.__name__
    # the control: two values on the axis are lines, one per series
    (ax,) = _drawn(monkeypatch, lambda out: report_module._fig_vs_axis(_rows([1.0], [1, 2]), out, "batch", "x",
                                                                      ["series", "model"], "T (lines: a / b)"))
    assert len(ax.lines) == 2 and not ax.patches
    for fig in (report_module._fig_vs_model, report_module._fig_memory):
        axes = _drawn(monkeypatch, lambda out, fig=fig: fig(_rows([1e6, 2e6], [1]), out))
        assert all(len(ax.lines) == 2 and not ax.patches for ax in axes), fig.__name__
