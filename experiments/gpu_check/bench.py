"""Phase bench: megatrain against DeepSpeed ZeRO-3 CPU offload through the harness, then a context sweep."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from .common import DS_BUILD, FINAL, SWEEP_NAME, Ctx, _first_error, _log, _read_json


def bench_points(dry: bool) -> list[tuple[str, Any]]:
    """(group, point) in the order they run: the megatrain/ZeRO-3 pairs first, the context sweep after."""
    from experiments.spec import Point

    if dry:
        common = {"precision": "fp32", "warmup": 0, "steps": 1}
        return [("pair", Point("megatrain", "tiny", 64, micro_batch=2, **common)),
                ("pair", Point("zero3", "tiny", 64, micro_batch=2, **common)),
                ("context", Point("megatrain", "tiny", 128, micro_batch=1, **common))]
    common = {"precision": "bf16", "warmup": 1, "steps": 2}
    out = []
    for model in ("qwen2.5-1.5b", "qwen2.5-3b"):
        for backend in ("megatrain", "zero3"):
            out.append(("pair", Point(backend, model, 4096, micro_batch=4, **common)))
    for seq, backend in ((32768, "megatrain"), (8192, "megatrain"), (32768, "zero3"), (16384, "megatrain")):
        out.append(("context", Point(backend, "qwen2.5-1.5b", seq, micro_batch=1, **common)))
    return out


POINT_CAP_S = {"megatrain": 150.0, "zero3": 210.0, "torch": 150.0}
POINT_MIN_S = 40.0  # not worth starting with less: building a multi-GB model alone takes ~15 s
DRY_POINT_CAP_S = 120.0
DRY_POINT_MIN_S = 8.0


def phase_bench(ctx: Ctx) -> None:
    from experiments import results as R
    from experiments.runner import point_columns, run_sweep
    from experiments.spec import Sweep
    from megatrain.metrics.provenance import provenance, utc_now

    csv = ctx.out / "results.csv"
    cap = DRY_POINT_CAP_S if ctx.dry else None
    least = DRY_POINT_MIN_S if ctx.dry else POINT_MIN_S
    zero3 = ctx.zero3
    points = bench_points(ctx.dry)
    if zero3 == "build":
        # The compile takes the CPU cores the engine's optimizer and ZeRO-3's CPU Adam run on: wait a
        # little for it, then time the megatrain points first and the ZeRO-3 ones once it is done.
        zero3 = _await_ds_build(ctx, 30.0)
        if zero3 == "building":
            points = sorted(points, key=lambda gp: gp[1].backend == "zero3")
    overlapped = []
    for group, pt in points:
        left = ctx.deadline - time.time() - 2.0
        if pt.backend == "zero3" and zero3 == "building":
            _log("bench: waiting for the DeepSpeed build")
            zero3 = _await_ds_build(ctx, left - 2 * least)
            zero3 = "on" if zero3 == "building" else zero3  # out of patience: the point finishes the build
            left = ctx.deadline - time.time() - 2.0
        elif zero3 == "building":
            overlapped.append(pt.label)
            ctx.info(timed_while_deepspeed_compiled=overlapped)
        reason = None
        if pt.backend == "zero3" and zero3 != "on":
            reason = zero3.partition(":")[2] or "ZeRO-3 not run"
        elif left < least:
            reason = f"out of the check's time budget ({left:.0f} s left, a point needs >= {least:.0f} s)"
        if reason is not None:
            row = {**point_columns(pt, SWEEP_NAME), **provenance(), "status": "skipped", "reason": reason,
                   "timestamp": utc_now()}
            R.append_row(csv, row)
            ctx.check(f"{group}:{pt.label}", lambda r=reason: {"ok": True, "status": "skipped", "reason": r})
            continue
        pt = dataclasses.replace(pt, timeout_s=float(min(cap or POINT_CAP_S[pt.backend], left)))

        def one(pt: Any = pt) -> dict[str, Any]:
            sweep = Sweep(SWEEP_NAME, "experiments/gpu_check.py", "the GPU check's bench phase", [pt])
            summary = run_sweep(sweep, out_dir=ctx.out, force=True, progress=False, log=_log)
            status = summary.statuses.get(pt.point_id, "failed")
            row = R.read_rows(csv).set_index("point_id").loc[pt.point_id].to_dict()
            return {"ok": status == "ok", "status": status, "reason": row.get("reason"),
                    "point_id": pt.point_id, "step_time_s": row.get("step_time_s")}

        ctx.check(f"{group}:{pt.label}", one)


def _await_ds_build(ctx: Ctx, max_wait_s: float) -> str:
    """The background DeepSpeed build's outcome: 'on', 'off:<why>', or 'building' after `max_wait_s`."""
    limit = time.time() + max(0.0, max_wait_s)
    while True:
        rec = _read_json(ctx.out / "phases" / f"{DS_BUILD.name}.json") or {}
        if rec.get("status") in FINAL:
            break
        if time.time() > limit:
            return "building"
        time.sleep(1.0)
    if rec["status"] == "ok":
        return "on"
    return f"off:DeepSpeed's CPU Adam did not build ({rec['status']}: {_first_error(rec)})"
