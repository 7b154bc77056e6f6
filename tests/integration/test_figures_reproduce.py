"""Every figure committed under results/ is drawn again from the data committed beside it, byte for byte: the
sweeps' report figures from their results.csv (and timeline traces) through `megatrain report`, the host-mode
study's loss curves from its loss_curves.csv through the study's own --merge. A change to the harness that moved a
figure (another axis, a dropped point, a new default) fails here; regenerating the figure on purpose means
committing the new PNG beside the change."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from kit import ROOT, run_python

SWEEPS = ["quick", "moe"]


def _pngs(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.png"))


@pytest.mark.parametrize("sweep", SWEEPS)
def test_a_sweeps_figures_reproduce_from_its_results(sweep, tmp_path):
    src = ROOT / "results" / sweep
    names = _pngs(src)
    assert names, f"results/{sweep} holds no figure to check"
    work = tmp_path / sweep
    shutil.copytree(src, work, ignore=shutil.ignore_patterns("*.png", "report.md"))  # the data only
    proc = run_python(["-m", "megatrain.commands.cli", "report", str(work)], cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _pngs(work) == names
    moved = [n for n in names if (work / n).read_bytes() != (src / n).read_bytes()]
    assert not moved, f"figures drawn differently from results/{sweep}'s data: {moved}"


def test_the_host_mode_studys_loss_curves_reproduce(tmp_path):
    src = ROOT / "results" / "host_modes"
    data = tmp_path / "data"
    data.mkdir()
    for name in ("loss_curves.csv", "meta.json"):
        shutil.copy(src / name, data / name)
    out = tmp_path / "out"
    proc = run_python(["-m", "experiments.studies.host_modes_study", "--merge", str(data), "--out", str(out)],
                      cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "loss_curves.png").read_bytes() == (src / "loss_curves.png").read_bytes()
