"""Probe every causal LM the installed transformers ships and write the measured compatibility table.

    python -m experiments.studies.compat                      # docs/COMPATIBILITY.md + results/compat/compat.csv
    python -m experiments.studies.compat --only llama gemma   # a few types, printed

Each model type is built from its default config shrunk by the parity probe (megatrain/engine/probe.py) and
trained three steps with plain PyTorch and with MegaTrain on the CPU: exact / mismatch / refused (reason) /
crashed (the tiny model or the run failed). Nothing here is written by hand.
"""

from __future__ import annotations

import argparse
import csv
import platform
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

from megatrain.check import causal_lm_types, check_model
from megatrain.engine.probe import Verdict

ROOT = Path(__file__).resolve().parents[2]
FIELDS = ["model_type", "architecture", "status", "max_grad_rel", "max_loss_diff", "detail"]
TIMEOUT_S = 120


class _Timeout(Exception):
    pass


def _alarm(signum, frame):  # noqa: ARG001
    raise _Timeout


def probe_type(model_type: str) -> dict:
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(TIMEOUT_S)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            v = check_model(model_type)
    except _Timeout:
        v = Verdict("crashed", f"the probe took longer than {TIMEOUT_S} s", "?")
    except Exception as exc:  # noqa: BLE001 - every type gets a row, whatever goes wrong
        v = Verdict("crashed", f"{type(exc).__name__}: {exc}", "?")
    finally:
        signal.alarm(0)
    detail = " ".join(v.detail.split())
    return {"model_type": model_type, "architecture": v.architecture, "status": v.status,
            "max_grad_rel": "" if v.max_grad_rel is None else f"{v.max_grad_rel:.1e}",
            "max_loss_diff": "" if v.max_loss_diff is None else f"{v.max_loss_diff:.1e}",
            "detail": detail[:300] + ("..." if len(detail) > 300 else "")}


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write(rows: list[dict], md: Path, out_csv: Path) -> None:
    out_csv.parent.mkdir(parents=True, exist_ok=True)
    with out_csv.open("w", newline="") as f:
        w = csv.DictWriter(f, FIELDS)
        w.writeheader()
        w.writerows(rows)
    counts = {s: sum(r["status"] == s for r in rows) for s in ("exact", "mismatch", "refused", "crashed")}
    lines = [
        "# Which architectures MegaTrain trains exactly",
        "",
        "Measured, not written: `python -m experiments.studies.compat` builds every causal-LM model type of the "
        "installed transformers from its default config, shrunk by the parity probe (2 layers, hidden 64, "
        "vocabulary 256; every structural option kept), and trains it 3 SGD steps with plain PyTorch and with "
        "MegaTrain on the CPU. **exact**: first-step gradients within 1e-5 (relative) and per-step losses within "
        "1e-5; **mismatch**: they differ (MegaTrain refuses the model); **refused**: MegaTrain declines it by "
        "name before training (the reason is given); **crashed**: the tiny model could not be built or run "
        "(often a default config that needs other inputs, e.g. a vision tower). The engine runs the same probe on "
        "first use of any architecture and refuses what is not exact; `megatrain check-model TYPE_OR_PATH` runs "
        "it on demand.",
        "",
        f"transformers {transformers.__version__}, torch {torch.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()} CPU, commit {_commit()}. "
        + ", ".join(f"{n} {s}" for s, n in counts.items()) + f" of {len(rows)} model types.",
        "",
        "| model type | class | verdict | worst grad err | worst loss diff | detail |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        detail = r["detail"].replace("|", "\\|")
        lines.append(f"| {r['model_type']} | {r['architecture']} | {r['status']} | {r['max_grad_rel']} | "
                     f"{r['max_loss_diff']} | {detail} |")
    md.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="probe these model types and print the rows; write nothing")
    ap.add_argument("--md", default=str(ROOT / "docs" / "COMPATIBILITY.md"))
    ap.add_argument("--csv", default=str(ROOT / "results" / "compat" / "compat.csv"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    types = args.only or causal_lm_types()
    rows = []
    for t in (bar := tqdm(types, unit="type", dynamic_ncols=True)):
        bar.set_postfix_str(t)
        rows.append(probe_type(t))
        r = rows[-1]
        tqdm.write(f"{t}: {r['status']} {r['max_grad_rel']} {r['max_loss_diff']} {r['detail'][:160]}")
    if not args.only:
        write(rows, Path(args.md), Path(args.csv))
        print(f"wrote {args.md} and {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
