"""One point where it lands: the planner's preflight against this machine, the point in its own
subprocess with a time limit, and this machine's provenance.

Why a subprocess per point: an OOM kill, a hung collective or DeepSpeed's process-global state
(one distributed init per process) then costs one point, not the sweep. Every executor runs
`execute_point`, locally or on a cluster node; the runner, which drives the executors, is not
needed here, so the executors depend on this module and never on the runner.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.spec import Point

REPO_ROOT = Path(__file__).resolve().parents[1]
_ERROR_LINE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)|RuntimeError|AssertionError)\b")


@dataclass
class Preflight:
    ok: bool
    reason: str = ""
    needed_host: float | None = None
    needed_device: float | None = None
    available_host: float | None = None
    available_device: float | None = None


def preflight(pt: Point) -> Preflight:
    """The planner's verdict on whether `pt` fits this machine; permissive when there is no planner
    (the subprocess isolation still contains an OOM)."""
    try:
        from megatrain import planner
    except ImportError:
        planner = None
    if planner is None or not hasattr(planner, "preflight"):
        return Preflight(ok=True, reason="no planner installed: preflight skipped")
    dtype = "bfloat16" if pt.precision == "bf16" else "float32"
    kw: dict[str, Any] = {}
    if pt.backend == "megatrain":
        # The engine's own settings, so the planner sizes what will run (e.g. activations stay on
        # the device unless the spec offloads them).
        from megatrain.config.schema import EngineConfig

        kw["engine_config"] = EngineConfig.from_dict({"compute_dtype": dtype, **pt.engine})
    else:
        kw["gradient_checkpointing"] = pt.recompute
    if pt.backend.startswith("zero3"):
        # the bucket sizes the run overrides size its device buffers too
        names = {"stage3_prefetch_bucket_size": "zero3_prefetch_bucket",
                 "stage3_param_persistence_threshold": "zero3_persistence_threshold",
                 "reduce_bucket_size": "zero3_reduce_bucket"}
        kw.update({names[k]: int(v) for k, v in pt.zero3.items() if k in names and not isinstance(v, str)})
    try:
        res = planner.preflight(pt.preset, pt.seq_len, pt.micro_batch, backend=pt.backend, dtype=dtype,
                                grad_accum=pt.grad_accum, **kw)
    except Exception as e:  # noqa: BLE001 - a planner gap must not stop a sweep; the point guards itself
        return Preflight(ok=True, reason=f"preflight failed, point run unchecked: {type(e).__name__}: {e}")
    return Preflight(
        ok=bool(res.ok),
        reason=str(res.reason or ""),
        needed_host=res.host_needed,
        needed_device=res.device_needed,
        available_host=res.host_available,
        available_device=res.device_available,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(pt: Point) -> dict[str, str]:
    """The environment of a point's process: this checkout importable, DeepSpeed's op cache and a free
    rendezvous port for zero3."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    # DeepSpeed builds its C++ ops with ninja from the venv, and caches them; a stable cache
    # directory pays the ~85 s build once per machine instead of once per point.
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    if pt.backend.startswith("zero3"):
        from baselines.zero3 import default_extensions_dir

        env.setdefault("TORCH_EXTENSIONS_DIR", default_extensions_dir())
    if pt.backend.startswith("zero3"):
        # A fresh port per point: other runs on the machine may hold the default one.
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env["MASTER_PORT"] = str(_free_port())
        for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
            env.setdefault(k, v)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def last_error_line(log: str) -> str:
    """The line that best explains a failure: the last exception line, else the last line."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if _ERROR_LINE.match(ln):
            return ln[:500]
    return lines[-1][:500] if lines else "(no output)"


def _kill_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def run_point_subprocess(pt: Point, out_dir: Path, python: str = sys.executable,
                         on_tick: Any = None) -> dict[str, Any]:
    """Run one point in a child process; returns the row fields it produced (status included).

    The child works in `out_dir` (made absolute here, against this process's working directory): the paths it is
    given mean what they meant to the caller, and whatever it writes beside them stays inside the results."""
    out_dir = Path(out_dir).absolute()
    work, logs, traces = out_dir / ".work", out_dir / "logs", out_dir / "traces"
    for d in (work, logs, traces):
        d.mkdir(parents=True, exist_ok=True)
    pid = pt.point_id
    result_file = work / f"{pid}.json"
    result_file.unlink(missing_ok=True)
    log_file = logs / f"{pid}.log"
    trace_file = traces / f"{pid}.json"
    trace_file.unlink(missing_ok=True)  # a trace left by an earlier run must not pass for this one's
    cmd = [python, "-m", "experiments.point", "--point", json.dumps(pt.to_dict()),
           "--result", str(result_file), "--trace", str(trace_file), "--parent-pid", str(os.getpid())]
    t0 = time.monotonic()
    timed_out = False
    with open(log_file, "w") as log:
        log.write(f"# {pt.label}  point_id={pid}\n# {' '.join(cmd[:3])} ...\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(pt),
                                cwd=str(out_dir), start_new_session=True)
        try:
            while True:
                try:
                    proc.wait(timeout=0.5)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if on_tick is not None:
                    on_tick(time.monotonic() - t0)
                if time.monotonic() - t0 > pt.timeout_s:
                    timed_out = True
                    _kill_group(proc)
                    break
        except BaseException:
            # Ctrl-C or a crash of the runner: never leave a point running unsupervised.
            _kill_group(proc, grace_s=2.0)
            raise
    wall = time.monotonic() - t0
    log_text = log_file.read_text(errors="replace")
    row: dict[str, Any] = {}
    result = None
    if result_file.exists():
        try:
            result = json.loads(result_file.read_text())
        except ValueError:
            result = None
    if result is not None:
        # A result written before a hang at exit (or a kill) is still a complete measurement.
        row.update(result)
        if row.get("status") != "ok" and not row.get("reason"):
            row["reason"] = last_error_line(log_text)
    elif timed_out:
        row.update(status="timeout",
                   reason=f"timed out after {pt.timeout_s:g} s; last output: {last_error_line(log_text)}")
    elif proc.returncode is not None and proc.returncode < 0:
        sig = signal.Signals(-proc.returncode).name
        hint = " (the kernel's out-of-memory killer sends this)" if sig == "SIGKILL" else ""
        row.update(status="failed", reason=f"killed by {sig}{hint}; last output: {last_error_line(log_text)}")
    else:
        row.update(status="failed",
                   reason=f"exit code {proc.returncode}: {last_error_line(log_text)}")
    # The runner's clock, not the child's: process start-up and imports are part of a point's cost.
    row.update(log_file=str(log_file.relative_to(out_dir)), wall_s=round(wall, 3))
    if trace_file.exists():
        row["trace_file"] = str(trace_file.relative_to(out_dir))
    row.setdefault("status", "failed")
    result_file.unlink(missing_ok=True)
    return row


def execute_point(pt: Point, out_dir: Path, python: str = sys.executable, on_tick: Any = None,
                  prov: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything a point adds to its row, measured where it runs: the preflight against this
    machine, the isolated run (or `skipped`), and this machine's provenance (`prov` when the
    caller already has it). Every executor runs this, locally or on a cluster node."""
    from megatrain.metrics.provenance import provenance

    pre = preflight(pt)
    fields: dict[str, Any] = dict(preflight_host_bytes=pre.needed_host, preflight_device_bytes=pre.needed_device,
                                  available_host_bytes=pre.available_host,
                                  available_device_bytes=pre.available_device)
    if not pre.ok:
        fields.update(status="skipped", reason=pre.reason or "preflight: does not fit")
    else:
        fields.update(run_point_subprocess(pt, out_dir, python=python, on_tick=on_tick))
    prov = provenance() if prov is None else prov
    # The point names its device when it knows better (the GPU it ran on); the runner stamps the time.
    fields.update({k: v for k, v in prov.items()
                   if k != "timestamp" and not (k == "device_name" and fields.get("device_name"))})
    return fields
