"""Phase sanitizer: parity runs under PyTorch's CUDA stream sanitizer (TORCH_CUDA_SANITIZER=1), which
reports any kernel that reads or writes a tensor another stream may still be using without an event
between them: a missing wait or `record_stream` fails here even when the timing happened to hide it. The
runs, their references and tolerances: sanitizer_run.py.

The sanitizer must be on before the first CUDA call, so the run is a process of its own
(sanitizer_run.py, printing one JSON line). On a CPU (the dry run) the same
process runs without the sanitizer, which exists for CUDA only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from .common import REPO_ROOT, Ctx


def phase_sanitizer(ctx: Ctx) -> None:
    def run() -> dict[str, Any]:
        env = dict(os.environ)
        env.pop("TORCH_CUDA_SANITIZER", None)  # any value, even empty, turns it on
        if ctx.cuda:
            env["TORCH_CUDA_SANITIZER"] = "1"
        cmd = [sys.executable, "-m", "experiments.gpu_check.sanitizer_run", "--device", str(ctx.device)]
        timeout = max(5.0, ctx.deadline - time.time() - 2)
        proc = subprocess.run(cmd, cwd=str(REPO_ROOT), env=env, capture_output=True, text=True, timeout=timeout)
        last = proc.stdout.strip().splitlines()[-1:] or ["{}"]
        try:
            res = json.loads(last[0])
        except json.JSONDecodeError:
            res = {}
        res["returncode"] = proc.returncode
        if proc.returncode != 0:
            res["stderr_tail"] = proc.stderr[-3000:]
        res["ok"] = bool(proc.returncode == 0 and res.get("parity_ok") and res.get("sanitizer") == ctx.cuda)
        return res

    ctx.check("parity_under_sanitizer", run)
