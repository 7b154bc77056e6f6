"""The host-memory modes side by side for one training point: bytes per parameter, host total, fit,
exactness, the largest context and micro-batch this model trains at in each mode, and the settings to write
in the "megatrain" config section for it (`megatrain plan` prints it).

The modes and their bytes are megatrain/costs/modes.py's, the ones the engine allocates by; a mode the engine
would refuse at this point (e.g. the optimizer in backward with accumulation) is listed with the reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from megatrain.costs.modes import HostMaster
from megatrain.models.presets import PRESETS

from .hardware import Hardware
from .memory import fmt_bytes
from .point import Point, context_refusal, engine_refusal, with_point
from .point_plan import MODES as MODES
from .point_plan import SCALE_PRESETS as SCALE_PRESETS
from .point_plan import mode_point as mode_point
from .point_plan import (
    mode_settings,
    plan_mode,  # its points name their mode
)
from .search import largest_batch, largest_context


@dataclass
class ModeRow:
    label: str
    knobs: dict[str, Any]
    exact: bool
    refused: str | None  # why the engine (or its config) would refuse this mode at this point
    host_bytes: int | None  # None: the config refuses the mode here (nothing planned)
    bytes_per_param: float | None
    fits: bool  # fits in memory and the engine runs it (context included)
    largest_fitting: str | None  # the largest SCALE_PRESETS shape that fits in this mode, same point otherwise
    clipping: bool  # whether the row plans gradient clipping (the optimizer in backward cannot clip)
    max_context: int | None = None  # this model, this mode, the point's micro-batch: up to its positions
    max_batch: int | None = None  # this model, this mode, the point's context

    @property
    def settings(self) -> dict[str, Any]:
        """The mode as keys of the "megatrain" config section (EngineConfig's names)."""
        return mode_settings(self.knobs)


def mode_table(p: Point, hw: Hardware, search: bool = True) -> list[ModeRow]:
    rows = []
    sizes = sorted(SCALE_PRESETS, key=lambda n: PRESETS[n].param_count())
    for label, knobs in MODES:
        exact, clip = HostMaster(knobs["host_master"]).exact, p.grad_clip and not knobs["optimizer_in_backward"]
        try:
            q = mode_point(p, knobs)
        except ValueError as e:  # the point's EngineConfig refuses the mode (e.g. hilo in FP32 compute)
            rows.append(ModeRow(label, knobs, exact, str(e), None, None, False, None, clip))
            continue
        pl = plan_mode(q, hw)
        refused = engine_refusal(q)
        largest = max_ctx = max_b = None
        if search and refused is None:
            for name in sizes:
                if plan_mode(with_point(q, model=PRESETS[name]), hw).feasible:
                    largest = name
            max_ctx, max_b = largest_context(q, hw), largest_batch(q, hw)
        total = pl.memory.host_total
        rows.append(ModeRow(label, knobs, exact, refused, total, total / q.model.param_count(), pl.feasible, largest,
                            q.grad_clip, max_ctx, max_b))
    return rows


def format_mode_table(rows: list[ModeRow], host_capacity: int, p: Point | None = None) -> list[str]:
    """The table, each mode followed by its "megatrain" section settings; `p` (the planned point) names the
    model, micro-batch and context the max columns are for."""
    name, batch, ctx = (p.model.name, f"{p.batch}", f"{p.context:,}") if p is not None else ("this model", "", "")
    limit = f", up to its {p.model.max_positions:,} positions" if p is not None else ""
    out = [f"  host-memory modes at this point (host total of {fmt_bytes(host_capacity)}); each mode's settings go "
           "in the config's \"megatrain\" section:",
           f"    (max context: the longest {name} trains at micro-batch {batch}{limit}; max batch: the largest "
           f"micro-batch at context {ctx}; largest preset: the biggest of the paper's presets that fits this point)",
           f"    {'mode':<40}{'exact':<7}{'B/param':>8}{'host':>12}  {'fits':<5}{'max context':>12}{'max batch':>10}"
           "  largest preset"]
    why_not = context_refusal(p) if p is not None else None
    for r in rows:
        fit = "n/a" if r.refused else ("yes" if r.fits else "NO")
        per_param = "-" if r.bytes_per_param is None else f"{r.bytes_per_param:.2f}"
        host = "-" if r.host_bytes is None else fmt_bytes(r.host_bytes)
        line = (f"    {r.label:<40}{'yes' if r.exact else 'no':<7}{per_param:>8}"
                f"{host:>12}  {fit:<5}{_count(r.max_context):>12}{_count(r.max_batch):>10}"
                f"  {r.largest_fitting or '-'}")
        if r.refused:
            line += f"  (refused: {r.refused})"
        elif not r.clipping and r.knobs["optimizer_in_backward"]:
            line += "  (no clipping)"
        out.append(line)
        top = ", with \"gradient_clipping\": 0" if r.knobs["optimizer_in_backward"] else ""
        out.append(f"      \"megatrain\": {json.dumps(r.settings)}{top}")
    if why_not:
        out.append(f"    (no mode runs this point: the engine refuses it: {why_not})")
    return out


def _count(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"
