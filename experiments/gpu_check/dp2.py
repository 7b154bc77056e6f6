"""The 2-GPU phase: the node path (docs/DISTRIBUTED.md) on two devices of one node under torchrun, every layer
streamed, NCCL between the GPUs. Both ranks train as one process on the concatenated batch (FP32 losses within
1e-5, the project's data-parallel tolerance) while each rank copies about half a lone rank's bytes over its link
(h2d and d2h per step <= MAX_LINK_SHARE x the lone process's). Skipped, saying so, where fewer than two GPUs are
visible (the dry run hides them all); `run_node_pair(..., device="cpu")` runs the same check on gloo ranks
(tests/unit/test_gpu_check_dp2.py)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import REPO_ROOT, Ctx

WORKER = Path(__file__).with_name("dp2_worker.py")
TOL = 1e-5  # FP32 losses, against one process on the concatenated batch (tests/integration/test_node_path.py's)
MAX_LINK_SHARE = 0.6  # each rank's h2d/d2h bytes per step against a lone rank's: ~1/2 of them, shard maps' padding
ARGS = {"micro": 2, "world": 2, "steps": 3, "layers": 4}


def skip_reason(found: int) -> str | None:
    """Why the phase cannot run with `found` devices visible (None: it can)."""
    return None if found >= 2 else f"needs 2 GPUs (found {found})"


def run_node_pair(workdir: Path, device: str, timeout_s: float, rank_worker: Path = WORKER) -> dict[str, Any]:
    """Two ranks on the node path under torchrun and, beside them, one process on the concatenated batch: the
    check's figures and whether they hold. `rank_worker`: the ranks' script (the tests' negative control runs
    this worker with the all-gather broken)."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    pair, lone = workdir / "pair", workdir / "lone"
    pair.mkdir(parents=True)
    lone.mkdir(parents=True)
    deadline = time.time() + timeout_s
    log = open(workdir / "torchrun.log", "w")  # noqa: SIM115 - closed below, after the ranks end
    ranks = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                              str(rank_worker), str(pair),
                              json.dumps({**ARGS, "device": device, "path": "node"})],
                             env=env, cwd=str(REPO_ROOT), stdout=log, stderr=subprocess.STDOUT)
    try:
        whole = {**ARGS, "micro": ARGS["micro"] * ARGS["world"], "world": 1, "device": device, "path": "per_rank"}
        alone = subprocess.run([sys.executable, str(WORKER), str(lone), json.dumps(whole)], env=env,
                               cwd=str(REPO_ROOT), timeout=max(1.0, deadline - time.time()), capture_output=True,
                               text=True)
        if alone.returncode != 0:  # the record says why, not only that it exited
            tail = alone.stderr.strip().splitlines()[-3:]
            raise RuntimeError(f"the one-process reference exited {alone.returncode}: {' | '.join(tail)}")
        ranks.wait(timeout=max(1.0, deadline - time.time()))
    finally:
        if ranks.poll() is None:
            ranks.kill()
            ranks.wait()
        log.close()
    if ranks.returncode != 0:
        tail = (workdir / "torchrun.log").read_text(errors="replace").strip().splitlines()[-3:]
        raise RuntimeError(f"torchrun exited {ranks.returncode}: {' | '.join(tail)}")
    ref = json.loads((lone / "rank0.json").read_text())
    res = [json.loads((pair / f"rank{r}.json").read_text()) for r in range(2)]
    gaps = [abs(a - b) for r in res for a, b in zip(ref["losses"], r["losses"], strict=True)]
    loss_gap = math.nan if any(math.isnan(g) for g in gaps) else max(gaps)  # max() would pass over a NaN
    share = {f"rank{i}": {k: max(got[k] / alone[k] for got, alone in zip(r["stats"], ref["stats"], strict=True))
                          for k in ("h2d_bytes", "d2h_bytes")} for i, r in enumerate(res)}
    on_node = all((r["data_path"] or "").startswith("node:") and st["data_path"] == "node"
                  for r in res for st in r["stats"]) and all(st["data_path"] == "single" for st in ref["stats"])
    gathered = all(st["gathered_bytes"] > 0 and st["scattered_bytes"] > 0 for r in res for st in r["stats"])
    return {"ok": loss_gap <= TOL and on_node and gathered
            and all(v <= MAX_LINK_SHARE for s in share.values() for v in s.values()),
            "device": device, "backend": res[0]["backend"], "data_path": res[0]["data_path"],
            "loss_gap_fp32": loss_gap, "tol": TOL, "losses_one_process": ref["losses"], "losses_two_ranks": res[0]["losses"],
            "link_share_per_step": share, "max_link_share": MAX_LINK_SHARE,
            "lone_bytes_per_step": ref["stats"][-1], "rank_bytes_per_step": [r["stats"][-1] for r in res]}


def phase_dp2(ctx: Ctx) -> None:
    import torch

    found = torch.cuda.device_count() if ctx.cuda else 0
    reason = skip_reason(found)
    ctx.info(gpus=found)
    if reason is not None:
        ctx.data.update(status="skipped", reason=reason)
        return
    with tempfile.TemporaryDirectory(dir=ctx.out) as tmp:
        ctx.check("node_path_two_gpus", lambda: run_node_pair(Path(tmp), "cuda", ctx.deadline - time.time() - 2))
