"""Where the step waits: the planner's 7B-120B table before and after the step's bound work, beside published figures.

    python -m experiments.studies.step_bound [--out results/step_bound] [--label NAME] [--models ...] [--batches 1 4 8]

Every figure here is predicted: `megatrain.planner.plan` with the profiles of megatrain/data/hardware.yaml as
committed, at 4096 tokens per sequence, bf16 compute, host mode "auto". Each point is planned with the engine's
defaults and with the speculative host step off; each row carries plain PyTorch's prediction at the same point
from the same compute model (whether or not its state fits the device), the GPU's idle fraction and the term that
idles it longest. A planner of another commit gives the "before" table: run this file with that checkout first on
PYTHONPATH and `--label` naming it (results/step_bound/README.md). Published figures are measured by their
authors on their machines, beside ours for context only: no error is computed against them.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path
from typing import Any

from experiments.studies.published import SUPEROFFLOAD

MODELS = ("llama2-7b", "qwen2.5-14b", "qwen2.5-32b", "llama3.1-70b", "dense-120b")
HARDWARE = ("h200-pcie", "gh200", "h100-sxm")
BATCHES = (1, 4, 8)
CONTEXT = 4096
VARIANTS: dict[str, dict[str, Any]] = {"defaults": {}, "no speculative step": {"speculative_step": False}}
MEGATRAIN_PAPER = "MegaTrain, Yuan et al., arXiv 2604.05091 (2026), evaluation section"
PUBLISHED = [
    {"system": "DeepSpeed SuperOffload", "model": "14-20B", "hardware": "gh200", "point": "4 x 4096",
     "tflops": "~500-600", "source": SUPEROFFLOAD + " (up to ~600; its examples say ~500)"},
    {"system": "MegaTrain (paper, bf16 masters)", "model": "7B-14B", "hardware": "h200/gh200", "point": "paper's",
     "tflops": "264-284", "source": MEGATRAIN_PAPER},
]
FIELDS = ("label", "hardware", "model", "batch", "variant", "fits", "step_ms", "model_tflops", "gpu_idle_pct", "idle_cause",
          "torch_tflops", "torch_fits", "vs_torch")


def row(model: str, hardware: str, batch: int, variant: str, knobs: dict[str, Any], label: str = "") -> dict[str, Any]:
    from megatrain.planner import plan

    pl = plan(model, CONTEXT, batch, hardware=hardware, **knobs)
    torch = plan(model, CONTEXT, batch, hardware=hardware, backend="torch")
    tl = pl.timeline
    return {"label": label, "hardware": hardware, "model": model, "batch": batch, "variant": variant,
            # older planners make no host-mode choice (no .auto)
            "fits": pl.feasible if getattr(pl, "auto", None) is None else pl.auto.fits,
            "step_ms": round(1e3 * pl.time.step_s, 1),
            "model_tflops": round(pl.model_tflops, 1), "gpu_idle_pct": round(100 * tl.gpu_idle_fraction, 1),
            "idle_cause": tl.idle_cause, "torch_tflops": round(torch.model_tflops, 1), "torch_fits": torch.feasible,
            "vs_torch": round(pl.model_tflops / torch.model_tflops, 3)}


def table(models: tuple[str, ...] = MODELS, hardware: tuple[str, ...] = HARDWARE,
          batches: tuple[int, ...] = BATCHES, label: str = "") -> list[dict[str, Any]]:
    from tqdm import tqdm

    points = [(h, m, b) for h in hardware for m in models for b in batches]
    rows = []
    for h, m, b in tqdm(points, desc="planning", unit="point", disable=None):
        rows += [row(m, h, b, v, knobs, label) for v, knobs in VARIANTS.items()]
    return rows


def write(rows: list[dict[str, Any]], out: Path, label: str = "") -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"step_bound{'_' + label if label else ''}.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    with open(out / "published.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(PUBLISHED[0]))
        w.writeheader()
        w.writerows(PUBLISHED)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results/step_bound"))
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--hardware", nargs="+", default=list(HARDWARE))
    ap.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    ap.add_argument("--label", default="", help="names the planner's commit in the rows and the file name")
    a = ap.parse_args(argv)
    rows = table(tuple(a.models), tuple(a.hardware), tuple(a.batches), a.label)
    for r in rows:
        print(f"{r['hardware']:>9} {r['model']:>12} {r['batch']}x{CONTEXT} {r['variant']:>19}: "
              f"{r['model_tflops']:6.1f} TFLOPS, idle {r['gpu_idle_pct']:4.1f}% ({r['idle_cause']}), "
              f"torch {r['torch_tflops']:.1f} -> {r['vs_torch']:.2f}x")
    print(f"-> {write(rows, a.out, a.label)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
