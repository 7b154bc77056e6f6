"""Residency over model size (issue 41): the planner's predicted step for 7B-120B on four GPUs, each layer streamed
and recomputed ("stream", the engine before residency) against the planner's placement ("auto": weights and
activations kept on the device where they fit), plain PyTorch where the whole model fits the device, and
DeepSpeed ZeRO-3 offload.

    python -m experiments.studies.residency_table [--out results/predicted]

Writes <out>/residency.csv (one row per model x hardware x batch x variant) and prints the TFLOPS table. Nothing
is measured: every figure is `megatrain.planner` with the profiles in megatrain/data/hardware.yaml as committed.
megatrain runs in the first host-memory mode (megatrain/planner/mode_table.py's order, the default first) whose
host side fits with every layer streamed, and both of its variants use that mode, so they differ only by where
the layers live.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path
from typing import Any

MODELS = ("llama2-7b", "llama3.1-8b", "qwen2.5-14b", "qwen2.5-32b", "llama3.1-70b", "dense-120b")
HARDWARE = ("h200-pcie", "gh200", "h100-sxm", "rtx4090")
CONTEXT = 4096
BATCHES = (1, 8)
VARIANTS = ("stream", "auto", "torch", "zero3")
FIELDS = ["model", "params", "hardware", "context", "micro_batch", "variant", "host_mode", "fits", "reason",
          "model_tflops", "step_s", "tokens_per_s", "gpu_idle_fraction", "gpu_idle_cause", "bottleneck",
          "residency_weights", "residency_activations", "placement", "engine_fill_weights",
          "engine_fill_activations", "engine_fill_tflops", "h2d_bytes_per_step", "recomputed_layers_per_step",
          "device_bytes", "host_bytes"]


def host_mode(model: str, hw: Any, batch: int) -> tuple[str, dict[str, Any]]:
    """The first host-memory mode whose streaming plan fits (the default when none does: the row says why)."""
    from megatrain.planner import MODES, make_point, plan_point

    for label, knobs in MODES:
        grad_clip = not knobs["optimizer_in_backward"]
        p = make_point(model, CONTEXT, batch, residency="stream", grad_clip=grad_clip, **knobs)
        if plan_point(p, hw).feasible:
            return label, {**knobs, "grad_clip": grad_clip}
    label, knobs = MODES[0]
    return label, dict(knobs)


def _row(pl: Any, variant: str, mode: str) -> dict[str, Any]:
    p, t, lc = pl.point, pl.time, pl.long_context
    tl = pl.timeline
    engine_fill = pl.placement.engine if pl.placement is not None else None
    fill_s = pl.placement.step_s.get(engine_fill) if engine_fill is not None else None
    return {
        "model": p.model.name, "params": p.model.param_count(), "hardware": pl.hardware.name, "context": p.context,
        "micro_batch": p.batch, "variant": variant, "host_mode": mode, "fits": pl.feasible,
        "reason": "" if pl.feasible else "; ".join(r for r in pl.reasons + pl.refused if "DOES NOT FIT" in r),
        "model_tflops": round(pl.model_tflops, 2), "step_s": round(t.step_s, 4),
        "tokens_per_s": round(pl.tokens_per_s, 1),
        "gpu_idle_fraction": None if tl is None else round(tl.gpu_idle_fraction, 4),
        "gpu_idle_cause": None if tl is None else tl.idle_cause, "bottleneck": t.bottleneck,
        "residency_weights": None if lc is None else lc.residency.weights,
        "residency_activations": None if lc is None else lc.residency.activations,
        "placement": pl.residency_line or "",
        "engine_fill_weights": None if engine_fill is None else engine_fill.weights,
        "engine_fill_activations": None if engine_fill is None else engine_fill.activations,
        "engine_fill_tflops": None if fill_s is None else round(pl.model_flops / fill_s / 1e12, 2),
        "h2d_bytes_per_step": t.h2d_bytes, "recomputed_layers_per_step": t.recomputed_layers,
        "device_bytes": pl.memory.device_total, "host_bytes": pl.memory.host_total,
    }


def build_rows(models: tuple[str, ...] = MODELS, hardware: tuple[str, ...] = HARDWARE,
               batches: tuple[int, ...] = BATCHES) -> list[dict[str, Any]]:
    from megatrain.planner import get_hardware, make_point, plan_point

    rows = []
    for hw_name in hardware:
        hw = get_hardware(hw_name)
        for model in models:
            for batch in batches:
                mode, knobs = host_mode(model, hw, batch)
                for variant in VARIANTS:
                    if variant in ("stream", "auto"):
                        p = make_point(model, CONTEXT, batch, residency=variant, **knobs)
                    else:  # plain PyTorch without checkpointing (its point: the model fits); ZeRO-3 as the baseline
                        p = make_point(model, CONTEXT, batch, backend=variant,
                                       gradient_checkpointing=variant == "zero3")
                    rows.append(_row(plan_point(p, hw), variant, mode if variant in ("stream", "auto") else ""))
    return rows


def tflops_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: predicted model TFLOPS per model and hardware, stream -> auto (torch where it fits)."""
    cells: dict[tuple[str, str, int], dict[str, Any]] = {}
    for r in rows:
        cells.setdefault((r["model"], r["hardware"], r["micro_batch"]), {})[r["variant"]] = r
    hws = list(dict.fromkeys(r["hardware"] for r in rows))
    out = ["| model | batch | " + " | ".join(hws) + " |", "|---|---|" + "---|" * len(hws)]
    for (model, batch) in dict.fromkeys((r["model"], r["micro_batch"]) for r in rows):
        parts = []
        for hw in hws:
            c = cells[(model, hw, batch)]
            s, a, t = c["stream"], c["auto"], c["torch"]
            if not a["fits"]:
                parts.append("does not fit")
                continue
            cell = f"{s['model_tflops']:.0f} -> **{a['model_tflops']:.0f}** ({a['residency_weights']}w/" \
                   f"{a['residency_activations']}a)"
            if t["fits"]:
                cell += f", torch {t['model_tflops']:.0f}"
            parts.append(cell)
        out.append(f"| {model} | {batch}x{CONTEXT} | " + " | ".join(parts) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results/predicted")
    args = ap.parse_args(argv)
    rows = build_rows()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "residency.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    print(tflops_table(rows))
    print(f"wrote {out / 'residency.csv'} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
