"""Residency under an emulated device budget, the engine against the planner (a benchmark, not a test).

    python -m experiments.studies.residency_budget [--preset llama-100m] [--seq 512] [--batch 2] [--steps 3]
                                                  [--shares 1.0,0.6,0] [--out results/residency]

On this CPU the engine plans its "auto" residency against `device_budget_bytes` as it would against a GPU's
memory. For each budget (a share of the whole-resident budget: the one at which every layer keeps its weights and
its forward graph; share 0: the streaming plan's own peak, room for nothing more) it trains `steps` steps (FP32,
fused AdamW) and records the residency it chose, its host->device bytes and recomputed layers per step, and its
losses, next to a `residency: "stream"` run of the same model and data (the losses must be bit-identical) and to the
planner's prediction for the engine's fill at the same budget (`megatrain.planner.plan`, its replay of the same
issue order). Writes OUT/budget.csv and prints it.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from megatrain.config.schema import EngineConfig
from megatrain.costs.memory import BUDGET_HEADROOM
from megatrain.costs.residency import Residency
from megatrain.engine import Engine
from megatrain.models.presets import get_preset
from megatrain.planner import plan

from .scaling import write_csv


def _train(preset: str, seq: int, batch: int, steps: int, **cfg) -> tuple[list[float], dict]:
    import transformers

    p = get_preset(preset)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(p.hf_config())
    eng = Engine(model, EngineConfig(device="cpu", compute_dtype="float32", **cfg),
                 optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True))
    ids = torch.randint(0, p.vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    losses = []
    eng.reset_stats()
    for _ in range(steps):
        out = eng(input_ids=ids, labels=ids)
        eng.backward(out.loss)
        eng.step()
        eng.zero_grad()
        losses.append(out.loss.item())
    return losses, eng.collect_stats()


def whole_resident_budget(preset: str, seq: int, batch: int) -> tuple[int, int]:
    """(the budget at which "auto" keeps every layer's weights and graph, the streaming plan's own budget)."""
    import transformers

    p = get_preset(preset)
    eng = Engine(transformers.AutoModelForCausalLM.from_config(p.hf_config()),
                 EngineConfig(device="cpu", compute_dtype="float32", residency="stream"))
    policy = eng.pipeline.policy
    n = len(eng.store.layers)
    streaming = policy.plan(seq * batch).predicted_peak_bytes
    whole = dataclasses.replace(policy, residency=Residency(n, n), budget=1 << 62).plan(seq * batch)
    return int(whole.predicted_peak_bytes / BUDGET_HEADROOM) + 1, int(streaming / BUDGET_HEADROOM) + 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-100m")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--shares", default="1.0,0.6,0")
    ap.add_argument("--out", default="results/residency")
    a = ap.parse_args()
    whole, streaming = whole_resident_budget(a.preset, a.seq, a.batch)
    ref, ref_stats = _train(a.preset, a.seq, a.batch, a.steps, residency="stream")
    rows = []
    for share in (float(s) for s in a.shares.split(",")):
        budget = int(streaming + share * (whole - streaming))
        losses, st = _train(a.preset, a.seq, a.batch, a.steps, device_budget_bytes=budget)
        cfg = EngineConfig(device="cpu", compute_dtype="float32", device_budget_bytes=budget)
        pl = plan(a.preset, a.seq, a.batch, dtype="float32", hardware="cpu", engine_config=cfg)
        fill = pl.placement.engine if pl.placement is not None else pl.time.residency
        _, p_h2d, p_rec = pl.placement.replayed[fill] if pl.placement is not None else (
            None, pl.time.h2d_bytes, pl.time.recomputed_layers)
        h2d, rec = st["h2d_bytes"] / a.steps, st["recomputed_layers"] / a.steps
        rows.append({
            "preset": a.preset, "tokens": a.seq * a.batch, "share_of_whole_resident": share, "budget_bytes": budget,
            "kept_weights": int(st["resident_weight_layers"]), "kept_graphs": int(st["kept_graph_layers"]),
            "planner_fill": f"{fill.weights}/{fill.activations}",
            "planner_choice": (f"{pl.placement.chosen.weights}/{pl.placement.chosen.activations}"
                               if pl.placement is not None else ""),
            "h2d_bytes_per_step": h2d, "planner_h2d_bytes_per_step": p_h2d,
            "h2d_error": h2d / p_h2d - 1 if p_h2d else float("nan"),
            "recomputed_per_step": rec, "planner_recomputed_per_step": p_rec,
            "stream_h2d_bytes_per_step": ref_stats["h2d_bytes"] / a.steps,
            "stream_recomputed_per_step": ref_stats["recomputed_layers"] / a.steps,
            "losses_identical_to_stream": losses == ref, "losses": losses,
        })
    write_csv(rows, Path(a.out) / "budget.csv")
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
