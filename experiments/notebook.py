"""`megatrain report DIR --notebook`: notebooks/figures.ipynb run headless on DIR, its figures written as PNG files.

The notebook reads its results folder from MEGATRAIN_RESULTS_DIR (the checkout's results/ when unset); a sweep's own
folder (`megatrain sweep --out DIR`, its results.csv at the top) is its measured sweep, and the figures it has no
files for say so and are skipped. Executed with nbclient in a kernel of this interpreter's venv (the `dev` extra).
"""

from __future__ import annotations

import base64
import os
import re
from contextlib import contextmanager
from pathlib import Path

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "figures.ipynb"
RESULTS_ENV = "MEGATRAIN_RESULTS_DIR"


class NotebookError(RuntimeError):
    """The notebook could not be run: nbclient or a kernel is missing, or a cell failed."""


@contextmanager
def _env(name: str, value: str):
    before = os.environ.get(name)
    os.environ[name] = value  # the kernel is a child process: it inherits this environment
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")[:60] or "figure"


def figure_files(nb, out_dir: Path) -> list[Path]:
    """Write every PNG the executed notebook shows to `out_dir`, named by the section heading above it."""
    written: list[Path] = []
    heading = "figure"
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            found = re.search(r"^#+\s*(.+)$", cell.source, re.M)
            heading = _slug(found.group(1)) if found else heading
            continue
        for out in cell.get("outputs", []):
            png = out.get("data", {}).get("image/png") if out.get("output_type") in ("display_data",
                                                                                    "execute_result") else None
            if png:
                path = out_dir / f"{len(written) + 1:02d}_{heading}.png"
                path.write_bytes(base64.b64decode(png))
                written.append(path)
    return written


def run_notebook(results_dir: str | Path, out_dir: str | Path, notebook: Path = NOTEBOOK,
                 timeout_s: int = 300) -> list[Path]:
    """Run `notebook` on `results_dir`; write the executed notebook and its figures to `out_dir`. Returns the
    files written (the notebook first)."""
    try:
        import nbclient
        import nbformat
    except ImportError as e:
        raise NotebookError(f"running the notebook needs nbclient, nbformat and ipykernel ({e}); install them with "
                            "pip install 'megatrain[dev]'") from None
    if not notebook.is_file():
        raise NotebookError(f"no notebook at {notebook}: --notebook runs the one in a checkout of the project")
    results, out = Path(results_dir).absolute(), Path(out_dir).absolute()
    out.mkdir(parents=True, exist_ok=True)
    nb = nbformat.read(notebook, as_version=4)
    # the kernel works in notebooks/, where the notebook finds the checkout; the results come from the variable
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=timeout_s,
                                     resources={"metadata": {"path": str(notebook.parent)}})
    with _env(RESULTS_ENV, str(results)):
        try:
            client.execute()
        except Exception as e:  # noqa: BLE001 - nbclient's and jupyter_client's errors: one message with the cause
            raise NotebookError(f"{notebook.name} failed on {results}: {type(e).__name__}: "
                                f"{' '.join(str(e).split())[:600]}") from None
    executed = out / notebook.name
    nbformat.write(nb, executed)
    return [executed, *figure_files(nb, out)]
