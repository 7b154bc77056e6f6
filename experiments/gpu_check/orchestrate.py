"""Runs the phases in supervised child processes, enforces every phase's deadline, publishes the summary."""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .bandwidth import phase_bandwidth
from .bench import phase_bench
from .common import (
    _T0,
    BENCH_MIN_S,
    DRY_TOTAL_BUDGET_S,
    FINAL,
    PHASES,
    REPO_ROOT,
    SUMMARY_RESERVE_S,
    TOTAL_BUDGET_S,
    Ctx,
    _atomic_write,
    _json_default,
    _log,
    _read_json,
)
from .dp2 import phase_dp2
from .env import phase_env
from .features import phase_features
from .parity import phase_parity
from .sanitizer import phase_sanitizer
from .stress import phase_stress
from .summary import build_summary, render_markdown
from .sync import phase_sync

PHASE_FNS: dict[str, Callable[[Ctx], None]] = {
    "env": phase_env, "bandwidth": phase_bandwidth, "parity": phase_parity, "features": phase_features,
    "sync": phase_sync, "stress": phase_stress, "sanitizer": phase_sanitizer, "dp2": phase_dp2,
    "bench": phase_bench,
}


def phase_budget(name: str, names: list[str], dry: bool, deadline: float, now: float,
                 budgets: dict[str, float] | None = None) -> float:
    """A phase's seconds: its own cap, cut to what is left of the whole budget, and, for a phase that runs before
    the bench in the same process, cut further so the bench keeps BENCH_MIN_S (the bench itself takes all that is
    left on a GPU). A phase with under 3 s is skipped."""
    spec = SPECS[name]
    own = (budgets or {}).get(name, spec.dry_budget_s if dry else spec.budget_s)
    left = deadline - SUMMARY_RESERVE_S - now
    if name == "bench":
        return left if not dry and name not in (budgets or {}) else min(own, left)
    if "bench" in names[names.index(name) + 1:]:
        left -= BENCH_MIN_S
    return min(own, left)


def run_phases(names: list[str], out: Path, dry: bool, deadline: float, inject: dict[str, str],
               budgets: dict[str, float] | None = None) -> int:
    """Child side: run these phases in order in this process (imports are paid once).

    Each phase records its own deadline; the parent kills this process when one is passed and starts
    a fresh one for the phases after it. After a phase that raised on a GPU this process exits too: a
    CUDA error can poison the context for everything after it.
    """
    for name in names:
        if inject.get(name) == "nostart":  # for the tests: this process dies before any phase starts
            raise ModuleNotFoundError(f"injected: no module named 'torch' (phase {name} could not start)")
    import torch

    if set(names) - {"bench"}:
        # Paid once here, outside any phase's budget (transformers alone takes seconds to import).
        with contextlib.suppress(ImportError):
            import megatrain.engine  # noqa: F401
    for name in names:
        budget = phase_budget(name, names, dry, deadline, time.time(), budgets)
        if budget < 3:
            _atomic_write(out / "phases" / f"{name}.json", json.dumps(
                {"phase": name, "status": "skipped", "reason": "no time left in the check's budget", "checks": {}}))
            continue
        _log(f"{name}: started (budget {budget:.0f} s)")
        ctx = Ctx(name, out, dry, time.time() + budget)
        try:
            if inject.get(name) == "fail":
                raise RuntimeError(f"injected failure in phase {name}")
            if inject.get(name) == "hang":
                time.sleep(3600)
            PHASE_FNS[name](ctx)
            ctx.finish()
        except Exception as exc:  # noqa: BLE001 - recorded; the parent carries on with the next phase
            traceback.print_exc()
            ctx.data.update(status="failed", reason=f"{type(exc).__name__}: {exc}"[:500])
            ctx._write()
            if ctx.cuda:
                return 3
        _log(f"{name}: {ctx.data['status']} ({time.time() - ctx.started:.1f} s)")
        if ctx.cuda:
            gc.collect()  # engines hold reference cycles; their device buffers go back before the next phase
            torch.cuda.empty_cache()
    return 0


# == orchestration ==========================================================================================
SPECS = {p.name: p for p in PHASES}
GRACE_S = 3.0


class Orchestrator:
    """Runs the phases in a supervised child process (on the CPU the bench in a second one beside it),
    enforces every phase's deadline, and publishes the summary after each phase."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dry = args.dry_run
        self.out = Path(args.out)
        self.bundle = Path(args.bundle) if args.bundle else None
        budget = args.budget_s or (DRY_TOTAL_BUDGET_S if self.dry else TOTAL_BUDGET_S)
        self.deadline = _T0 + budget
        self.inject = [i for i in args.inject]
        self.only = set(args.only.split(",")) if args.only else None
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", GPU_CHECK_T0=str(_T0))
        self.env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + ([self.env["PYTHONPATH"]]
                                                                     if self.env.get("PYTHONPATH") else []))
        # Deterministic cuBLAS, so the stress phase can ask for equal results, not close ones.
        self.env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        if self.dry:
            self.env["CUDA_VISIBLE_DEVICES"] = ""  # tiny shapes on the CPU, even on a GPU machine

    def _cmd(self, phases: list[str]) -> list[str]:
        cmd = [sys.executable, "-m", "experiments.gpu_check", "--phase", ",".join(phases), "--out", str(self.out),
               "--deadline", str(self.deadline)]
        if self.dry:
            cmd.append("--dry-run")
        for item in self.inject:
            cmd += ["--inject", item]
        for item in self.args.phase_budget:
            cmd += ["--phase-budget", item]
        return cmd

    def _spawn(self, phases: list[str]) -> tuple[subprocess.Popen, collections.deque]:
        """The child, and the last lines of its stderr: still printed as they come (the log keeps them), and kept,
        so a process that dies before its phase starts can say why in that phase's record."""
        proc = subprocess.Popen(self._cmd(phases), cwd=str(REPO_ROOT), env=self.env, start_new_session=True,
                                stderr=subprocess.PIPE, text=True, errors="replace")
        tail: collections.deque = collections.deque(maxlen=STDERR_TAIL_LINES)
        threading.Thread(target=_tee, args=(proc.stderr, tail), name="gpu-check-stderr", daemon=True).start()
        return proc, tail

    def _record(self, name: str) -> dict[str, Any] | None:
        return _read_json(self.out / "phases" / f"{name}.json")

    def _finalize(self, name: str, status: str, reason: str, **extra: Any) -> None:
        rec = self._record(name) or {"phase": name, "checks": {}}
        rec.update(status=status, reason=reason, **extra)
        if rec.get("started"):
            rec["wall_s"] = round(time.time() - rec["started"], 1)
        _atomic_write(self.out / "phases" / f"{name}.json", json.dumps(rec, indent=1))
        _log(f"{name}: {status}: {reason}")

    def run(self) -> int:
        self.out.mkdir(parents=True, exist_ok=True)
        for f in (self.out / "phases").glob("*.json"):
            f.unlink()  # a record from an earlier run must not pass for this one's
        todo = [p.name for p in PHASES
                if (self.dry or not p.optional if self.only is None else p.name in self.only)]
        plans = []
        if self.dry and "bench" in todo and len(todo) > 1:
            # Timings mean nothing on the CPU: run the bench beside the rest instead of after it.
            plans += [[n for n in todo if n != "bench"], ["bench"]]
        elif todo:
            plans.append(todo)
        groups = [dict(zip(("proc", "tail"), self._spawn(names)), todo=names) for names in plans]
        published: set[str] = set()
        while groups:
            time.sleep(0.2)
            for g in list(groups):
                if not self._supervise(g):
                    groups.remove(g)
            if time.time() > self.deadline + GRACE_S:
                for g in groups:  # a phase that never got to set its own deadline
                    _kill_group(g["proc"])
                    for n in g["todo"]:
                        if (self._record(n) or {}).get("status") not in FINAL:
                            self._finalize(n, "timeout", "the whole check ran out of its time budget")
                groups = []
            done = {n for n in SPECS if (self._record(n) or {}).get("status") in FINAL}
            if done - published:
                published |= done
                self.publish()
        self.publish(final=True)
        statuses = {n: (self._record(n) or {}).get("status") for n in SPECS}
        bad = {n: s for n, s in statuses.items() if s not in (None, "ok", "skipped")}
        return 1 if bad else 0

    def _supervise(self, g: dict[str, Any]) -> bool:
        """Kill a child whose current phase is past its deadline, or notice that it died; go on with a fresh
        one for the phases after the broken one. False once the group has nothing left to run."""
        proc, todo = g["proc"], g["todo"]
        recs = {n: self._record(n) or {} for n in todo}
        current = next((n for n in todo if recs[n].get("status") == "running"), None)
        exited = proc.poll() is not None
        if current is not None and not exited and time.time() > recs[current]["deadline"] + GRACE_S:
            _kill_group(proc)
            self._finalize(current, "timeout", f"exceeded its {recs[current]['budget_s']:.0f} s budget; "
                                               "checks finished before that are kept")
        elif not exited:
            return True
        elif current is not None:
            self._finalize(current, "failed", f"its process died (exit code {proc.returncode})"
                           + _why(_stderr_tail(g)))
        else:
            first = next((n for n in todo if recs[n].get("status") not in FINAL), None)
            if first is not None and proc.returncode != 0:
                why = _stderr_tail(g)
                self._finalize(first, "failed", f"its process exited (code {proc.returncode}) before it started"
                               + _why(why), stderr_tail=why)
        rest = [n for n in todo if (self._record(n) or {}).get("status") not in FINAL]
        if not rest:
            return False
        g["proc"], g["tail"] = self._spawn(rest)
        g["todo"] = rest
        return True

    # -- outputs ---------------------------------------------------------------------------------------
    def publish(self, final: bool = False) -> None:
        try:
            phases = {n: r for n in SPECS if (r := self._record(n)) is not None}
            summary = build_summary(self.out, phases, self.dry)
            _atomic_write(self.out / "summary.json", json.dumps(summary, indent=1, default=_json_default))
            md = render_markdown(summary)
            _atomic_write(self.out / "summary.md", md)
            if self.bundle is not None:
                self.copy_bundle(summary)
        except Exception:  # noqa: BLE001 - a summary bug must not cost the measurements
            traceback.print_exc()
            md = "(summary failed; see the traceback above and phases/*.json)"
        if final:
            print("\n" + md, flush=True)

    def copy_bundle(self, summary: dict[str, Any]) -> None:
        b = self.bundle
        b.mkdir(parents=True, exist_ok=True)
        for name in ("summary.md", "summary.json", "results.csv"):
            if (self.out / name).exists():
                shutil.copyfile(self.out / name, b / name)
        tl = summary.get("timeline", {}).get("trace_file")
        if tl and (self.out / tl).exists():
            shutil.copyfile(self.out / tl, b / "timeline.json")
        tmp = b / ".gpu_check.tar.gz.tmp"
        with tarfile.open(tmp, "w:gz") as tar:
            tar.add(self.out, arcname="gpu_check")
        os.replace(tmp, b / "gpu_check.tar.gz")






STDERR_TAIL_LINES = 40


def _tee(stream: Any, tail: collections.deque) -> None:
    for line in stream:
        sys.stderr.write(line)
        tail.append(line.rstrip("\n"))
    stream.close()


def _stderr_tail(g: dict[str, Any]) -> str:
    """The dead child's last stderr lines, once its reader has drained the pipe."""
    proc = g["proc"]
    deadline = time.time() + 2.0
    while proc.stderr is not None and not proc.stderr.closed and time.time() < deadline:
        time.sleep(0.02)
    return "\n".join(g["tail"])


def _why(tail: str) -> str:
    """The reason's end: the child's last error line (a traceback ends with it), or that it printed none."""
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    return f": {lines[-1][:300]}" if lines else ": it printed nothing on stderr"


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, 15)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        proc.wait()


# == summary ================================================================================================
