"""The host-memory modes side by side for one training point: bytes per parameter, host total, fit,
exactness, and the largest preset that fits in each mode (`megatrain plan` prints it).

The modes and their bytes are megatrain/costs/modes.py's, the ones the engine allocates by; a mode the engine
would refuse at this point (e.g. the optimizer in backward with accumulation) is listed with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatrain.costs.modes import HostMaster
from megatrain.models.presets import PRESETS

from .estimate import plan_point
from .hardware import Hardware
from .memory import fmt_bytes
from .point import Point, engine_refusal, with_point

# (label, EngineConfig knobs under the planner's names); the first is the default.
MODES: list[tuple[str, dict[str, Any]]] = [
    ("fp32 master, fp32 grads (default)", dict(master="fp32", host_grad_dtype="float32", optimizer_in_backward=False)),
    ("hilo master, fp32 grads", dict(master="hilo", host_grad_dtype="float32", optimizer_in_backward=False)),
    ("hilo master, bf16 grads", dict(master="hilo", host_grad_dtype="bfloat16", optimizer_in_backward=False)),
    ("fp32 master, optimizer in backward", dict(master="fp32", host_grad_dtype="float32", optimizer_in_backward=True)),
    ("hilo master, optimizer in backward", dict(master="hilo", host_grad_dtype="float32", optimizer_in_backward=True)),
    ("bf16 master, bf16 grads (paper's code)", dict(master="bf16", host_grad_dtype="bfloat16",
                                                    optimizer_in_backward=False)),
    ("bf16 master, optimizer in backward", dict(master="bf16", host_grad_dtype="float32", optimizer_in_backward=True)),
]
# The shapes the "largest model that fits" column ranks (the paper's dense presets, by size).
SCALE_PRESETS = ["llama2-7b", "qwen2.5-7b", "llama3.1-8b", "qwen2.5-14b", "qwen2.5-32b", "llama3.1-70b",
                 "qwen2.5-72b", "dense-120b"]


@dataclass
class ModeRow:
    label: str
    knobs: dict[str, Any]
    exact: bool
    refused: str | None  # why the engine would refuse this mode at this point
    host_bytes: int
    bytes_per_param: float
    fits: bool
    largest_fitting: str | None  # the largest SCALE_PRESETS shape that fits in this mode, same point otherwise
    clipping: bool  # whether the row plans gradient clipping (the optimizer in backward cannot clip)


def mode_point(p: Point, knobs: dict[str, Any]) -> Point:
    """The point in one mode; the optimizer in backward cannot clip, so its rows plan without clipping."""
    return with_point(p, **knobs, grad_clip=p.grad_clip and not knobs["optimizer_in_backward"],
                      optimizer_overlap=p.optimizer_overlap and not knobs["optimizer_in_backward"])


def mode_table(p: Point, hw: Hardware, search: bool = True) -> list[ModeRow]:
    rows = []
    sizes = sorted(SCALE_PRESETS, key=lambda n: PRESETS[n].param_count())
    for label, knobs in MODES:
        q = mode_point(p, knobs)
        pl = plan_point(q, hw)
        refused = engine_refusal(q)
        largest = None
        if search and refused is None:
            for name in sizes:
                if plan_point(with_point(q, model=PRESETS[name]), hw).fits:
                    largest = name
        total = pl.memory.host_total
        rows.append(ModeRow(label, knobs, HostMaster(knobs["master"]).exact, refused, total,
                            total / q.model.param_count(), pl.fits and refused is None, largest, q.grad_clip))
    return rows


def format_mode_table(rows: list[ModeRow], host_capacity: int) -> list[str]:

    out = [f"  host-memory modes at this point (host total of {fmt_bytes(host_capacity)}; "
           "largest = the biggest of the paper's presets that fits, same point otherwise):",
           f"    {'mode':<40}{'exact':<7}{'B/param':>8}{'host':>12}  {'fits':<5}largest"]
    for r in rows:
        fit = "n/a" if r.refused else ("yes" if r.fits else "NO")
        line = (f"    {r.label:<40}{'yes' if r.exact else 'no':<7}{r.bytes_per_param:>8.2f}"
                f"{fmt_bytes(r.host_bytes):>12}  {fit:<5}{r.largest_fitting or '-'}")
        if r.refused:
            line += f"  (refused: {r.refused})"
        elif not r.clipping and r.knobs["optimizer_in_backward"]:
            line += "  (no clipping)"
        out.append(line)
    return out
