"""The command line: `python -m experiments.gpu_check [--dry-run] [--out DIR] [--only PHASES]`."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from . import __doc__ as PACKAGE_DOC
from .common import DRY_TOTAL_BUDGET_S, PHASES, REPO_ROOT, TOTAL_BUDGET_S
from .orchestrate import SPECS, Orchestrator, run_phases


# == entry ====================================================================================================
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.gpu_check", description=PACKAGE_DOC.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="the same script on the CPU with tiny shapes")
    ap.add_argument("--out", default=None, help="results folder (default: results/gpu/<UTC time>, or a temp "
                                                "folder when $OUT is set)")
    ap.add_argument("--bundle", default=os.environ.get("OUT"),
                    help="where to copy the <= 6 files to bring back (default: $OUT)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help=f"whole-check budget from the wrapper's start (default {TOTAL_BUDGET_S:.0f}, "
                         f"dry run {DRY_TOTAL_BUDGET_S:.0f})")
    ap.add_argument("--only", default=None, help=f"comma-separated phases to run ({', '.join(SPECS)}; "
                                                 f"on a GPU {', '.join(p.name for p in PHASES if p.optional)} only when named)")
    ap.add_argument("--inject", action="append", default=[], metavar="PHASE=fail|hang",
                    help=argparse.SUPPRESS)  # for the tests: a phase that breaks
    ap.add_argument("--phase-budget", action="append", default=[], metavar="PHASE=SECONDS",
                    help=argparse.SUPPRESS)  # for the tests: a shorter budget
    ap.add_argument("--phase", default=None, help=argparse.SUPPRESS)  # child side: phases to run, in order
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.out is None:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        if os.environ.get("OUT"):
            args.out = f"/tmp/megatrain-gpu-check-{stamp}"  # fresh: never mixed with an earlier run's files
        else:
            args.out = str(REPO_ROOT / "results" / ("gpu-dry" if args.dry_run else "gpu") / stamp)
    if args.phase:
        names = args.phase.split(",")
        unknown = [n for n in names if n not in SPECS]
        if unknown:
            ap.error(f"unknown phase(s) {unknown}; known: {', '.join(SPECS)}")
        inject = dict(item.partition("=")[::2] for item in args.inject)
        budgets = {k: float(v) for k, v in (item.partition("=")[::2] for item in args.phase_budget)}
        deadline = args.deadline or time.time() + (DRY_TOTAL_BUDGET_S if args.dry_run else TOTAL_BUDGET_S)
        return run_phases(names, Path(args.out), args.dry_run, deadline, inject, budgets)
    return Orchestrator(args).run()
