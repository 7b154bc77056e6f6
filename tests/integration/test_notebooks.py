"""Every notebook in notebooks/ runs headless, top to bottom, on the committed results."""

from __future__ import annotations

from pathlib import Path

import nbclient  # noqa: E402
import nbformat  # noqa: E402
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    # a glob that matches nothing would make the parametrized test below vanish silently
    assert NOTEBOOKS, "no notebooks found in notebooks/"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path: Path):
    nb = nbformat.read(path, as_version=4)
    # python3 is the venv's own kernelspec when ipykernel is installed there; the notebooks plan
    # GPU-scale points with the planner, which is arithmetic, so a minute per cell is generous.
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=120,
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError on the first failing cell
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
