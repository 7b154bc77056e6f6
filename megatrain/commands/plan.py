"""`megatrain plan` and `megatrain bench`: the planner's own flags and printing are megatrain/planner/cli.py's (also
`python -m megatrain.planner`); here the command adds a harness sweep spec's predicted rows (--sweep, CSV with the
commit that made them) and the bench that measures this machine into a profile."""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from ..config.settings import planner_knobs
from ..config.validate import unknown_key
from ..planner import add_plan_args, flag_knobs, flag_profiles, plan, profile_from_dict, resolve_model
from ..planner import run_plan as run_point

# Keys of the harness's sweep specs (experiments/sweeps/*.yaml) the planner uses; the rest (warmup,
# steps, timeout_s, threads, seed, lr) do not change a prediction.
_SPEC_TOP = ("name", "description", "defaults", "grid", "grids", "points")


def sweep_points(spec: str | Path) -> list[dict[str, Any]]:
    """The points of a sweep spec in the harness's format (defaults + grid/grids + points; a list
    is an axis, `engine` may be a list of mappings), as plain dicts. Read here rather than through
    experiments/, which the planner may not import."""
    with open(spec) as f:
        d = yaml.safe_load(f) or {}
    if not isinstance(d, dict):
        raise ValueError(f"{spec}: a sweep spec must be a mapping with grid, grids or points")
    found = unknown_key(d, _SPEC_TOP)
    if found:
        unknown = set(d) - set(_SPEC_TOP)
        hint = f" (did you mean {found[1]!r}?)" if found[1] else ""
        raise ValueError(f"{spec}: unknown top-level key(s) {sorted(unknown)}{hint}; known: {', '.join(_SPEC_TOP)}")
    defaults = dict(d.get("defaults") or {})
    grids = ([d["grid"]] if d.get("grid") else []) + list(d.get("grids") or [])
    points = []
    for grid in grids:
        keys = list(grid)
        axes = [v if isinstance(v, list) else [v] for v in grid.values()]
        for combo in itertools.product(*axes):
            points.append({**defaults, **dict(zip(keys, combo))})
    points += [{**defaults, **pt} for pt in (d.get("points") or [])]
    if not points:
        raise ValueError(f"{spec}: the spec defines no points")
    return points


def _spec_to_plan_kwargs(pt: dict[str, Any], knobs: dict[str, Any]) -> dict[str, Any]:
    model = resolve_model(pt["model"])
    if pt.get("max_positions"):
        model = model.with_(max_positions=int(pt["max_positions"]))
    kw: dict[str, Any] = dict(model=model, context=int(pt["seq_len"]), batch=int(pt.get("micro_batch", 1)),
                              grad_accum=int(pt.get("grad_accum", 1)), backend=pt["backend"],
                              dtype="bfloat16" if pt.get("precision", "fp32") == "bf16" else "float32",
                              grad_clip=float(pt.get("grad_clip", 1.0)) > 0)
    if pt["backend"] == "megatrain":
        eng = dict(pt.get("engine") or {})
        kw.update({k: v for k, v in knobs.items() if k not in eng})
        if "residency" in eng:  # the planner's own knob (costs/residency.py), validated by make_point
            kw["residency"] = eng.pop("residency")
        kw.update(planner_knobs(eng))
    else:
        kw["gradient_checkpointing"] = bool(pt.get("recompute", True))
    return kw


def run_sweep(spec: str | Path, hardware: str | list[str] = "h200-pcie",
              knobs: dict[str, Any] | None = None, **overrides: Any) -> list[dict[str, Any]]:
    """Predicted rows (source=predicted) for every point of a harness sweep spec on each hardware.

    knobs: megatrain planner knobs for settings the spec's `engine` mapping leaves unset (e.g.
    offload_activations='auto'); overrides: link_gbs / host_memory_gib / device_memory_gib.
    A point that cannot be planned becomes a row with status=failed and the reason; the sweep goes on.
    """
    hws = [h.strip() for h in hardware.split(",")] if isinstance(hardware, str) else list(hardware)
    name = Path(spec).stem
    rows = []
    for pt in sweep_points(spec):
        for hw in hws:
            try:
                kw = _spec_to_plan_kwargs(pt, knobs or {})
                for k, v in overrides.items():
                    if v is not None:
                        kw.setdefault(k, v)
                row = plan(hardware=hw, **kw).to_row()
            except (ValueError, TypeError, KeyError) as e:
                row = {"source": "predicted", "hardware": hw, "status": "failed", "reason": str(e),
                       "backend": pt.get("backend"), "model": pt.get("model"), "seq_len": pt.get("seq_len")}
            rows.append({"sweep": name, **row})
    return rows


def _provenance() -> dict[str, Any]:
    """Which code made the predictions (the planner follows costs/memory.py, so the commit matters)."""
    from ..metrics.provenance import git_commit, package_versions, utc_now

    commit, dirty = git_commit()
    return {"git_commit": commit, "git_dirty": dirty, "versions": package_versions(), "timestamp": utc_now()}


def _write_rows(rows: list[dict[str, Any]], out: str | None) -> None:
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    f = open(out, "w", newline="") if out else sys.stdout
    try:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    finally:
        if out:
            f.close()


def run_bench(args: argparse.Namespace) -> int:
    from ..metrics.bench import bench

    prof = bench(quick=args.quick, min_time=args.min_time, threads=args.threads)
    raw = prof.pop("raw")
    if raw.get("warning"):
        print(f"warning: {raw['warning']}", file=sys.stderr)
    name = prof.pop("name")
    profile_from_dict(name, prof)  # validate before writing
    text = yaml.safe_dump({"profiles": {args.name or name: prof}}, sort_keys=False, width=200)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        print(json.dumps({"profile": prof, "raw": raw}, indent=2))
    else:
        print(text)
        print("# raw: " + json.dumps(raw))
    return 0


def run_plan(args: argparse.Namespace) -> int:
    """The `plan` command: a sweep spec's rows (--sweep), else the planner's plan of one point or job; a bad name or
    value prints one error line and returns 2."""
    if not getattr(args, "sweep", None):
        return run_point(args)
    try:
        if (args.gpus_per_node, args.nodes) != (1, 1):
            raise ValueError("--gpus-per-node/--nodes plan one point; drop them with --sweep")
        if getattr(args, "trainable", None):
            raise ValueError("--trainable prices one point's partial training; drop it with --sweep")
        rows = run_sweep(args.sweep, flag_profiles(args), knobs=flag_knobs(args), link_gbs=args.link_gbs,
                         host_memory_gib=args.host_memory_gib, device_memory_gib=args.device_memory_gib)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prov = _provenance()
    _write_rows([{**r, **prov} for r in rows], args.out)
    return 0


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `plan` on a subparsers object; sets args.func = run_plan (returns an exit code)."""
    ap = subparsers.add_parser("plan", help="predict memory, step time and fit for a training point",
                               description="Predict host/device memory per component, step time, throughput "
                                           "and fit (megatrain vs ZeRO-3 offload) from shapes and a hardware profile.")
    add_plan_args(ap)
    ap.add_argument("--sweep", help="a harness sweep spec (experiments/sweeps/*.yaml): predicted rows as CSV; "
                                    "megatrain knobs the spec's `engine` leaves unset come from these flags")
    ap.add_argument("--out", help="CSV to write --sweep rows to (default: stdout)")
    ap.set_defaults(func=run_plan)
    return ap


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `bench` on a subparsers object; sets args.func = run_bench (returns an exit code)."""
    ap = subparsers.add_parser("bench", help="measure this machine into a hardware profile",
                               description="Measure matmul rates, memory bandwidth, the CPU AdamW and the host "
                                           "link (or the emulated link on CPU) and print a hardware profile.")
    ap.add_argument("--quick", action="store_true", help="small sizes (seconds), for tests")
    ap.add_argument("--min-time", type=float, help="seconds of repeats per measurement (best rep is kept)")
    ap.add_argument("--threads", type=int, help="torch intra-op threads for the CPU measurements")
    ap.add_argument("--out", help="write the profile YAML here (load it with plan --hardware-file)")
    ap.add_argument("--name", help="profile name to write (default: cpu or cuda)")
    ap.add_argument("--json", action="store_true")
    ap.set_defaults(func=run_bench)
    return ap

