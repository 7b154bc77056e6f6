"""Long-context benchmark: the longest sequence each backend can train llama-100m on within one device-memory budget.

    python -m experiments.studies.long_context [--budget-gib 0.75] [--lengths 1024,2048,...] [--backends ...]

Each (backend, length) runs in its own process through the public face (`megatrain.Accelerator`, the way
a user runs each backend): two training steps (forward, backward, AdamW), the second timed, so the
optimizer state exists while it is measured. torch and zero3 use HF gradient checkpointing.

The budget is device memory. On a machine without a GPU it is accounted, for every backend alike, by
`megatrain.engine.runtime.memtrack.DeviceMemoryTracker`: the live bytes of every tensor the step allocates on
the compute device, plus what each backend keeps on the device for the whole run (torch: the
parameters; megatrain: its layer buffers and embedding/head; ZeRO-3 offload: nothing, its parameters
and optimizer live in host memory). An allocation that would pass the budget raises, as an
out-of-memory error would on a GPU. megatrain's engine is given the same budget (`device_budget_bytes`),
from which it plans its MLP tile and activation offload. Peak host RSS is recorded as well.

Lengths are tried in increasing order and a backend stops at its first point over budget. Writes
results/long_context/<model>/results.csv and README.md (machine, versions, commit, summary).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from experiments.execute import child_env
from experiments.spec import Point

REPO = Path(__file__).resolve().parents[2]
FIELDS = ["model", "backend", "seq_len", "fits", "status", "reason", "peak_device_bytes", "static_device_bytes",
          "budget_bytes", "tokens_per_s", "step_time_s", "mlp_tile_tokens", "loss_chunk_tokens", "activations_offloaded",
          "predicted_peak_device_bytes",
          "peak_rss_bytes", "wall_s", "alst_loss_tile"]


# -- one point, in its own process ---------------------------------------------------------------------

# ZeRO-3 as its defaults run it ("zero3"), and tuned for the least device memory ("zero3-lean"): gradient
# reduce buckets of 1M elements instead of the default 500M (which, at this size, holds every gradient on
# the device at once), nothing kept gathered between uses, no prefetch, no persistent small parameters. The
# lean one is the strongest ZeRO-3 a user chasing context length would configure, so megatrain is measured
# against it too.
ZERO3_LEAN = {"zero_optimization": {"reduce_bucket_size": 1_000_000, "stage3_max_live_parameters": 0,
                                    "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0,
                                    "stage3_param_persistence_threshold": 0}}
# "zero3-alst" adds DeepSpeed's own long-sequence pieces (baselines/alst.py: tiled loss, tiled MLP, checkpoints
# offloaded to the host) to the lean configuration: DeepSpeed at its best for context length on one device.
BACKENDS = {"megatrain": ("megatrain", {}), "torch": ("torch", {}), "zero3": ("zero3", {}),
            "zero3-lean": ("zero3", ZERO3_LEAN), "zero3-alst": ("zero3-alst", ZERO3_LEAN)}


def _point(model: str, backend: str, seq: int, max_pos: int) -> Point:
    face = BACKENDS[backend][0]  # a sweep point knows the stacks, not their variants: zero3-alst runs DeepSpeed
    return Point(backend="zero3" if face.startswith("zero3") else face, model=model, seq_len=seq,
                 max_positions=max_pos)


def worker(model_name: str, backend: str, seq: int, max_pos: int, budget: int,
           alst_loss_tile: int | None = None) -> dict[str, Any]:
    import torch

    from experiments.point import _find_engine, build_model
    from megatrain.accelerate import Accelerator
    from megatrain.engine.parts import DeviceMemoryTracker

    class OverBudget(MemoryError):
        pass

    class BudgetTracker(DeviceMemoryTracker):
        """Raises at the first allocation that takes the device past the budget."""

        def __init__(self, limit: int) -> None:
            super().__init__(torch.device("cpu"))
            self.limit = limit
            self.tripped = 0

        def _note(self, out: Any, inputs: Any) -> None:
            super()._note(out, inputs)
            if self.live > self.limit and not self.tripped:
                self.tripped = self.live
                raise OverBudget(f"device bytes would reach {self.live} > {self.limit}")

    pt = _point(model_name, backend, seq, max_pos)
    torch.manual_seed(0)
    backend, extra = BACKENDS[backend]
    config: dict[str, Any] = {"gradient_clipping": 1.0, **extra}
    if backend == "zero3-alst" and alst_loss_tile:
        config["alst"] = {"loss_tile_tokens": alst_loss_tile}
    if backend == "megatrain":
        config["megatrain"] = {"device_budget_bytes": budget}
    if backend == "zero3-alst":
        from baselines.alst import set_host_copy_context
        from megatrain.engine.parts import host_allocations

        set_host_copy_context(host_allocations)  # its offloaded checkpoints are host memory, as on a GPU machine
    acc = Accelerator(backend=backend, config=config, gradient_checkpointing=True)
    model = build_model(pt)
    # as the sweep harness: torch's fused kernel (no per-step temporaries of the foreach one); ZeRO offload
    # swaps in DeepSpeedCPUAdam
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    model, optimizer = acc.prepare(model, optimizer)
    engine = _find_engine(model, acc) if backend == "megatrain" else None
    if engine is not None:
        static = engine.device_weight_bytes
    elif backend == "torch":
        static = sum(p.numel() * p.element_size() for p in model.parameters())
    else:
        static = 0  # ZeRO-3 offload: parameters and optimizer state are host tensors
    tracker = BudgetTracker(budget - static)
    x = torch.randint(0, pt.preset.vocab, (1, seq), generator=torch.Generator().manual_seed(1))
    times = []
    try:
        for _ in range(2):
            t0 = time.perf_counter()
            with tracker.track():
                out = model(input_ids=x, labels=x)
                acc.backward(out.loss)
                del out
            # torch keeps AdamW's state and temporaries on the device; the others step on the host.
            if backend == "torch":
                with tracker.track():
                    optimizer.step()
                    optimizer.zero_grad()
            else:
                optimizer.step()
                optimizer.zero_grad()
            times.append(time.perf_counter() - t0)
    except Exception as exc:  # noqa: BLE001 - an over-budget allocation surfaces wrapped by autograd or DeepSpeed
        if not tracker.tripped:
            raise
        return {"status": "over_budget", "reason": f"needs > {(static + tracker.tripped) / 2**30:.3f} GiB "
                f"({type(exc).__name__})", "peak_device_bytes": static + tracker.tripped, "static_device_bytes": static}
    row = {"status": "ok", "reason": "", "peak_device_bytes": static + tracker.peak, "static_device_bytes": static,
           "step_time_s": times[-1], "tokens_per_s": seq / times[-1]}
    if engine is not None:
        st = engine.collect_stats()
        row.update({k: st[k] for k in ("mlp_tile_tokens", "loss_chunk_tokens", "activations_offloaded",
                                       "predicted_peak_device_bytes")})
    return row


def run_point(model: str, backend: str, seq: int, max_pos: int, budget: int, timeout_s: float,
              log_dir: Path, alst_loss_tile: int | None = None) -> dict[str, Any]:
    result = Path(tempfile.mkdtemp(prefix="lcbench-")) / "row.json"
    cmd = [sys.executable, "-m", "experiments.studies.long_context", "--worker", json.dumps(
        {"model": model, "backend": backend, "seq": seq, "max_pos": max_pos, "budget": budget, "result": str(result),
         "alst_loss_tile": alst_loss_tile})]
    t0 = time.perf_counter()
    with (log_dir / f"{backend}-{seq}.log").open("w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(_point(model, backend, seq, max_pos)), stdout=log,
                                stderr=subprocess.STDOUT)
        status = None
        while True:
            pid, code, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - t0 > timeout_s and status is None:
                status = "timeout"
                proc.kill()
            time.sleep(0.2)
        proc.returncode = code  # reaped by wait4 above
    row: dict[str, Any] = json.loads(result.read_text()) if result.exists() else {}
    if status is None and not row:
        status, row["reason"] = "failed", f"no result (exit status {code}); see {log.name}"
    out = {"model": model, "backend": backend, "seq_len": seq, "budget_bytes": budget, **row,
           "peak_rss_bytes": usage.ru_maxrss * 1024,  # Linux reports KiB; the whole process, model build included
           "wall_s": round(time.perf_counter() - t0, 1)}
    out["status"] = status or row.get("status", "failed")
    out["fits"] = out["status"] == "ok"
    return out


# -- the sweep and its report --------------------------------------------------------------------------

def write_readme(out: Path, rows: list[dict[str, Any]], args: argparse.Namespace, budget: int,
                 prov: dict[str, Any], wall: float) -> dict[str, int]:
    from megatrain.models.presets import get_preset

    lines = [
        "# Long-context benchmark (CPU)",
        "",
        f"The longest sequence each backend trains `{args.model}` "
        f"({get_preset(args.model).param_count() / 1e6:.0f}M parameters, FP32, micro-batch 1) on within one "
        "device-memory budget, and tokens/s at each length.",
        "",
        f"- **Budget: {budget / 2**30:.3f} GiB of device memory, by the engine's accounting** "
        "(`DeviceMemoryTracker`, the same for every backend, since this machine has no GPU): the live bytes of "
        "every tensor the step allocates, plus what the backend keeps on the device all run (torch: the "
        "parameters; megatrain: its layer buffers and embedding/head; ZeRO-3 offload: nothing). An allocation "
        "past the budget raises, as a GPU's out-of-memory would. DeepSpeed's buffers made during the step (its "
        "gradient reduce buckets, gathered parameters) count; those allocated before the first step do not.",
        "- `zero3` is DeepSpeed ZeRO-3 CPU offload with DeepSpeed's defaults; `zero3-lean` is the same tuned for the "
        "least device memory (1M-element reduce buckets instead of 500M, nothing kept gathered, no prefetch, no "
        "persistent parameters). `zero3-alst` is `zero3-lean` plus DeepSpeed's long-sequence (ALST) pieces: "
        "`TiledFusedLogitsLoss` (no full logits), `TiledMLP` (the MLP in sequence tiles) and DeepSpeed activation "
        "checkpointing with `cpu_checkpointing` (each layer's checkpoint in host memory, not counted as device "
        "memory; its copy back for the recompute is): the strongest ZeRO-3 a user chasing context length would "
        "configure.",
        "- Each point: its own process, the public `Accelerator(backend=...)`, two training steps (forward, "
        "backward, AdamW), the second timed. torch and zero3 with HF gradient checkpointing and HF's loss; "
        "megatrain with its defaults and `device_budget_bytes` set to the budget, from which it picks its "
        "sequence tile, its head/loss chunk and whether to offload boundary activations.",
        "- tokens/s comes from one step on a shared 2-core machine that other jobs were loading: compare "
        "backends at one length, not runs. Peak RSS is the whole process (model build included).",
        "- Lengths tried: " + "; ".join(f"{b} {', '.join(str(r['seq_len']) for r in rows if r['backend'] == b)}"
                                        for b in args.backends)
        + f"; a backend stops at its first point over budget. This run: {wall / 60:.1f} min.",
        "",
        "## Longest sequence within the budget",
        "",
        "| backend | longest fitting length | first length over budget |",
        "| --- | --- | --- |",
    ]
    longest = {}
    for b in args.backends:
        ok = [r["seq_len"] for r in rows if r["backend"] == b and r["fits"]]
        longest[b] = max(ok) if ok else 0
        over = next((r for r in rows if r["backend"] == b and not r["fits"]), None)
        capped = bool(ok) and over is None
        shown = f">= {longest[b]} (the longest tried)" if capped else str(longest[b])
        first_over = f"{over['seq_len']} ({over['status']}: {over['reason']})" if over else ""
        lines.append(f"| {b} | {shown} | {first_over} |")
    for other in ("torch", "zero3", "zero3-lean", "zero3-alst"):
        if other in longest and "megatrain" in longest:
            n = longest[other]
            lines.append("")
            fit_all = {b: not any(r["backend"] == b and not r["fits"] for r in rows) for b in ("megatrain", other)}
            note = (f" (not a bound: {other} fit every length tried)" if fit_all[other] else
                    " (a lower bound: megatrain fit every length tried)" if fit_all["megatrain"] else "")
            lines.append(f"megatrain / {other}: " + (f"{longest['megatrain'] / n:.1f}x{note}" if n else
                                                       f"{other} fits no length tried"))
    lines += ["", "## All points", "",
              "| backend | seq_len | status | device GiB | predicted GiB (planner) | error | of which static | "
              "tokens/s | step s | tile | loss chunk | offloaded | peak RSS GiB |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def fmt(v: Any, spec: str, scale: float = 1.0) -> str:
        return "" if v is None else format(v / scale, spec)

    errors: dict[str, list[float]] = {}
    for r in rows:
        pred = (predicted_peak(args.model, r["seq_len"], budget) if r["backend"] == "megatrain" else
                predicted_alst_peak(args.model, r["seq_len"], r.get("alst_loss_tile")) if r["backend"] == "zero3-alst"
                else predicted_zero3_peak(args.model, r["seq_len"]) if r["backend"] == "zero3" else None)
        err = None
        if pred is not None and r["fits"] and r.get("peak_device_bytes"):
            err = 100 * (pred / r["peak_device_bytes"] - 1)
            errors.setdefault(r["backend"], []).append(err)
        lines.append(" | ".join([
            f"| {r['backend']}", str(r["seq_len"]), r["status"], fmt(r.get("peak_device_bytes"), ".3f", 2**30),
            fmt(pred, ".3f", 2**30), fmt(err, "+.1f") + ("%" if err is not None else ""),
            fmt(r.get("static_device_bytes"), ".3f", 2**30), fmt(r.get("tokens_per_s"), ".1f"),
            fmt(r.get("step_time_s"), ".1f"), fmt(r.get("mlp_tile_tokens"), ".0f"), fmt(r.get("loss_chunk_tokens"), ".0f"),
            fmt(r.get("activations_offloaded"), ".0f"), fmt(r.get("peak_rss_bytes"), ".2f", 2**30)]) + " |")
    for b, label in (("megatrain", "`megatrain plan`, the engine's own policy"),
                     ("zero3", "`megatrain plan --backend zero3`"),
                     ("zero3-alst", "megatrain/planner/alst.py, the terms of what that configuration holds")):
        errs = errors.get(b)
        if errs:
            lines += ["", f"Memory model ({label}) vs measured peak device bytes over the {b} points that ran: worst "
                          f"error {max(errs, key=abs):+.1f}%, mean |error| {sum(map(abs, errs)) / len(errs):.1f}%."]
    reading = out / "reading.md"  # the reading of a run, written by hand, kept across report rebuilds
    if reading.exists():
        lines += ["", reading.read_text().rstrip()]
    lines += ["", "## Provenance", ""] + [f"- {k}: {v}" for k, v in prov.items()]
    lines += ["", f"Reproduce: `python -m experiments.studies.long_context --model {args.model} --budget-gib "
              f"{args.budget_gib} --lengths {','.join(map(str, args.lengths))} --backends {','.join(args.backends)}"
              + (f" --bisect {args.bisect}" if getattr(args, "bisect", 0) else "")
              + (f" --alst-loss-tile {args.alst_loss_tile}" if getattr(args, "alst_loss_tile", None) else "") + "`",
              ""]
    (out / "README.md").write_text("\n".join(lines))
    return longest


def predicted_peak(model: str, seq: int, budget: int) -> int:
    """The planner's device peak for megatrain at this point: micro-batch 1, FP32, the bench's budget, on the
    CPU (where the engine aliases the host's embedding and head)."""
    from megatrain.config.schema import EngineConfig
    from megatrain.planner import plan

    pl = plan(model, seq, batch=1, dtype="float32", backend="megatrain",
              engine_config=EngineConfig(device_budget_bytes=budget), hardware="cpu")
    return int(pl.long_context.peak_bytes)


def predicted_alst_peak(model: str, seq: int, loss_tile: int | None = None) -> int:
    """The planner's device peak for zero3-alst at this point: FP32, micro-batch 1, the backend's default MLP tile
    and `loss_tile` (None: its default)."""
    from megatrain.models.presets import get_preset
    from megatrain.planner import BUCKET_TERM, zero3_alst_device_terms

    terms = zero3_alst_device_terms(get_preset(model), seq, 4, loss_tile=int(loss_tile) if loss_tile else None)
    # DeepSpeed allocates its reduce bucket when it initializes: this bench's accounting, like its measurement,
    # starts at the first step
    return sum(v for k, v in terms.items() if k != BUCKET_TERM)


def predicted_zero3_peak(model: str, seq: int) -> int:
    """The planner's device peak for zero3 (DeepSpeed's defaults, HF checkpointing) at this point: FP32,
    micro-batch 1, on the CPU (no device runtime reserve)."""
    from megatrain.planner import plan

    return int(plan(model, seq, batch=1, dtype="float32", backend="zero3", hardware="cpu").memory.device_total)


def _backends(text: str) -> list[str]:
    names = [b.strip() for b in text.split(",") if b.strip()]
    bad = [b for b in names if b not in BACKENDS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown backend(s) {', '.join(bad)}; choose from {', '.join(BACKENDS)}")
    return names


def _kept_rows(path: Path, model: str, budget: int, rerun: list[str]) -> list[dict[str, Any]]:
    """Rows of an earlier run to merge with this one; refuses rows from another model or budget."""
    if not path.exists():
        return []
    with path.open() as f:
        rows = [r for r in csv.DictReader(f) if r["backend"] not in rerun]
    for r in rows:
        if r.get("model", model) != model or int(r["budget_bytes"]) != budget:
            raise SystemExit(f"--merge: {path} holds a run of model {r.get('model')!r} at budget "
                             f"{int(r['budget_bytes']) / 2**30:.3f} GiB; this run is {model!r} at "
                             f"{budget / 2**30:.3f} GiB. Use another --out, or drop --merge.")
    for r in rows:  # back to the types the report expects
        r["seq_len"] = int(r["seq_len"])
        r["fits"] = r["fits"] == "True"
        for k in ("peak_device_bytes", "static_device_bytes", "tokens_per_s", "step_time_s", "mlp_tile_tokens",
                  "loss_chunk_tokens", "activations_offloaded", "predicted_peak_device_bytes", "peak_rss_bytes",
                  "wall_s", "alst_loss_tile"):
            r[k] = float(r[k]) if r.get(k) not in (None, "") else None
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.studies.long_context", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-100m", help="model preset")
    ap.add_argument("--budget-gib", type=float, default=0.75, help="device-memory budget")
    ap.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1024, 2048, 3072, 4096, 6144, 8192])
    ap.add_argument("--backends", type=_backends, default=["megatrain", "torch", "zero3", "zero3-lean"],
                    help=f"comma-separated, of: {', '.join(BACKENDS)}")
    ap.add_argument("--timeout-s", type=float, default=3600.0, help="per point")
    ap.add_argument("--out", type=Path, help="default: results/long_context/<model>")
    ap.add_argument("--merge", action="store_true",
                    help="keep the rows already in OUT/results.csv for the backends not run now (same model and "
                         "budget), so backends can be run at different times")
    ap.add_argument("--report-only", action="store_true",
                    help="rewrite OUT/README.md from OUT/results.csv and OUT/provenance.json; run nothing")
    ap.add_argument("--bisect", type=int, default=0, metavar="TOKENS",
                    help="after a backend's first length over budget, bisect between it and the longest that fit "
                         "until they are at most TOKENS apart (a multiple of TOKENS is tried each time)")
    ap.add_argument("--alst-loss-tile", type=int, help="zero3-alst's loss tile in tokens (its `alst.loss_tile_tokens`; "
                                                       "default: the backend's 64 MiB of logits)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.out = args.out or REPO / "results" / "long_context" / args.model
    if args.worker:
        w = json.loads(args.worker)
        row = worker(w["model"], w["backend"], w["seq"], w["max_pos"], w["budget"], w.get("alst_loss_tile"))
        Path(w["result"]).write_text(json.dumps(row))
        return 0

    from megatrain.metrics.provenance import provenance

    budget = int(args.budget_gib * 2**30)
    if args.report_only:
        rows = _kept_rows(args.out / "results.csv", args.model, budget, [])
        saved = json.loads((args.out / "provenance.json").read_text())
        args.lengths = sorted({r["seq_len"] for r in rows})
        args.backends = sorted({r["backend"] for r in rows})
        print(json.dumps(write_readme(args.out, rows, args, budget, saved["provenance"], saved.get("wall_s", 0.0))))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="lcbench-logs-"))
    print(f"point logs: {log_dir}", flush=True)
    prov = provenance()
    t0 = time.perf_counter()
    rows = _kept_rows(args.out / "results.csv", args.model, budget, args.backends) if args.merge else []
    def run(backend: str, seq: int) -> dict[str, Any]:
        r = run_point(args.model, backend, seq, max(args.lengths), budget, args.timeout_s, log_dir,
                      args.alst_loss_tile)
        r["alst_loss_tile"] = args.alst_loss_tile if backend == "zero3-alst" else None
        rows.append(r)
        print(f"{backend:9s} {seq:6d} {r['status']:11s} device {(r.get('peak_device_bytes') or 0) / 2**30:6.3f} GiB "
              f"{(r.get('tokens_per_s') or 0):7.1f} tok/s  ({r['wall_s']:.0f} s)", flush=True)
        with (args.out / "results.csv").open("w", newline="") as f:  # rewritten after every point
            w = csv.DictWriter(f, FIELDS, extrasaction="ignore")
            w.writeheader()
            w.writerows(sorted(rows, key=lambda r: (r["backend"], int(r["seq_len"]))))
        return r

    for backend in args.backends:
        good = 0
        for seq in sorted(args.lengths):
            if not run(backend, seq)["fits"]:
                # memory grows with length: longer ones cannot fit either; the limit lies in (good, seq)
                bad = seq
                while args.bisect and bad - good > args.bisect:
                    mid = (good + bad) // 2 // args.bisect * args.bisect
                    if mid <= good:
                        break
                    if run(backend, mid)["fits"]:
                        good = mid
                    else:
                        bad = mid
                break
            good = seq
    (args.out / "provenance.json").write_text(json.dumps(
        {"provenance": prov, "wall_s": time.perf_counter() - t0}, indent=1))
    rows.sort(key=lambda r: (r["backend"], int(r["seq_len"])))
    args.backends = sorted({r["backend"] for r in rows})
    longest = write_readme(args.out, rows, args, budget, prov, time.perf_counter() - t0)
    print(json.dumps(longest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
