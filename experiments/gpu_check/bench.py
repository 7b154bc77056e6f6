"""Phase bench: the streamed step against plain PyTorch on the same layers, and the planner's prediction beside it.

The question users ask: what does streaming cost against PyTorch, and does the planner know? 8 layers of a 7B
model's width (llama2-7b's shapes: hidden 4096, MLP 11008, 32 heads, vocabulary 32000) at 1 x 4096 tokens, bf16
compute, three points in this order:

- `stream`: every layer streamed and recomputed (`residency: "stream"`): the 100B+ path, each layer's weights over
  the link twice a step and its gradients back, the host AdamW (speculated, as "auto" sets it);
- `torch`: plain PyTorch on the device (the same model, bf16 autocast over FP32 weights, fused AdamW), the
  baseline a user would otherwise run when the layers fit;
- `auto`: the engine's own placement for the device it finds.

Each point builds its model (a deterministic fill, not HF's init: seconds instead of a minute at this size), runs
one warm-up step, then timed steps until its share of the phase's time is spent (at least `MIN_STEPS`). Measured:
the step (median), tokens/s, model TFLOPS; for the engine the H2D/D2H bytes and GB/s over the step and while
copying, the GPU's idle fraction (the step's wall time not covered by the traced compute spans), speculation's
rollbacks; beside each, the planner's prediction for that point (megatrain.planner.plan with the link rate the
phase measures first) and its error in %. Rows go to results.csv (csv module only: no pandas on the GPU image).
The dry run runs the same points with a tiny model of the same structure, a few steps each.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

from .common import Ctx, _log, _sync

# llama2-7b's layer shapes; LAYERS of them (8-16 fit the phase's time on one H100/H200).
WIDTH_7B = {"hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32, "num_key_value_heads": 32,
            "vocab_size": 32000}
LAYERS = 8
SEQ = 4096
DRY_SHAPES = {"hidden_size": 64, "intermediate_size": 176, "num_attention_heads": 4, "num_key_value_heads": 4,
              "vocab_size": 256}
DRY_LAYERS, DRY_SEQ = 3, 64
MIN_STEPS = 2  # timed steps per point, whatever its share
DRY_STEPS = 2
BUILD_ALLOWANCE_S = 25.0  # a point's model build, engine setup and warm-up on a GPU machine, before its timed steps
FIELDS = ["point", "backend", "residency", "status", "reason", "layers", "hidden", "seq_len", "micro_batch",
          "steps", "step_time_s", "step_time_min_s", "tokens_per_s", "model_tflops", "h2d_bytes_per_step",
          "d2h_bytes_per_step", "h2d_gbps", "d2h_gbps", "h2d_gbps_busy", "d2h_gbps_busy", "gpu_idle_fraction",
          "speculative_layers", "speculative_rollbacks", "resident_weight_layers", "peak_device_bytes",
          "pred_step_time_s", "pred_h2d_gbps", "pred_d2h_gbps", "pred_gpu_idle_fraction", "pred_hardware",
          "pred_link_gbps", "err_step_pct", "err_h2d_pct", "err_d2h_pct", "err_idle_pct", "build_s", "device",
          "device_bytes_before", "trace_file"]


@dataclasses.dataclass(frozen=True)
class BenchPoint:
    name: str
    backend: str  # "megatrain" | "torch"
    residency: str | None  # megatrain: "stream" | "auto"
    layers: int
    hidden: int
    seq: int


def bench_points(dry: bool) -> list[BenchPoint]:
    """The points in the order they run: streamed first (the question), plain PyTorch, the engine's own placement."""
    layers, seq, hidden = (DRY_LAYERS, DRY_SEQ, DRY_SHAPES["hidden_size"]) if dry else (
        LAYERS, SEQ, WIDTH_7B["hidden_size"])
    # PyTorch before "auto": an engine frees its device memory when collected, and the ~42 GB "auto" keeps
    # beside a lingering one would leave PyTorch's ~33 GB no room on an 80 GB card
    return [BenchPoint("stream", "megatrain", "stream", layers, hidden, seq),
            BenchPoint("torch", "torch", None, layers, hidden, seq),
            BenchPoint("auto", "megatrain", "auto", layers, hidden, seq)]


def model_config(dry: bool) -> Any:
    import transformers

    shapes = DRY_SHAPES if dry else WIDTH_7B
    cfg = transformers.LlamaConfig(**shapes, num_hidden_layers=DRY_LAYERS if dry else LAYERS,
                                   max_position_embeddings=max(SEQ, 4096), tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    return cfg


def build_model(cfg: Any, device: str = "cpu", seed: int = 0) -> Any:
    """A Llama of `cfg` on `device` with deterministic weights, built without HF's init: its normal_ fill of
    ~2 B parameters takes a minute of CPU; a tiled block of random numbers takes seconds (the weights only need
    to be the same for every point and give a finite loss). Rotary tables are recomputed, norms set to one."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    model = model.to_empty(device=device)
    g = torch.Generator().manual_seed(seed)
    block = ((torch.rand(1 << 20, generator=g) - 0.5) * 0.04).to(device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            flat = p.view(-1)
            for i in range(0, flat.numel(), block.numel()):
                n = min(block.numel(), flat.numel() - i)
                flat[i:i + n].copy_(block[:n])
        rotary = model.model.rotary_emb
        fresh = type(rotary)(config=cfg)  # on the CPU: the keyword set of transformers 4.5x and 5.x alike
        for name, buf in fresh.named_buffers(recurse=False):
            getattr(rotary, name).copy_(buf)
    return model


def _batch(cfg: Any, seq: int, device: str) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, cfg.vocab_size, (1, seq), generator=g)
    return {"input_ids": ids.to(device), "labels": ids.to(device)}


def _link_gbps(ctx: Ctx) -> float | None:
    """Pinned host->device rate over 256 MiB (the planner's link input), best of 3; None on the CPU."""
    import torch

    if not ctx.cuda:
        return None
    n = 256 << 20
    src = torch.empty(n, dtype=torch.uint8).pin_memory()
    dst = torch.empty(n, dtype=torch.uint8, device=ctx.device)
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return n / best / 1e9


def hardware_profile(ctx: Ctx) -> str:
    """The planner's profile closest to this device by name (the measured link rate overrides its link)."""
    import torch

    if not ctx.cuda:
        return "cpu"  # the dry run: the planner's CPU-device profile, against what this CPU measures
    name = torch.cuda.get_device_name(0).lower()
    if "h200" in name:
        return "h200-pcie"
    if "gh200" in name:
        return "gh200"
    return "h100-sxm" if "h100" in name else "h200-pcie"


def predict(pt: BenchPoint, cfg: Any, ctx: Ctx, link: float | None) -> dict[str, Any]:
    """The planner's figures for this point (empty with the reason where it cannot say)."""
    try:
        from megatrain.planner import plan

        knobs: dict[str, Any] = {"residency": pt.residency} if pt.backend == "megatrain" else {}
        import os

        import torch

        hw = hardware_profile(ctx)
        # this machine's memory, not the profile's: "auto" places layers by what is really there
        host_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        dev_gib = torch.cuda.mem_get_info()[1] / 2**30 if ctx.cuda else None
        pl = plan(cfg, pt.seq, 1, hardware=hw, backend=pt.backend, link_gbs=link, host_memory_gib=host_gib,
                  device_memory_gib=dev_gib, **knobs)
        t = pl.time
        tl = pl.timeline if pt.backend == "megatrain" else None
        return {"pred_step_time_s": t.step_s, "pred_h2d_gbps": t.h2d_bytes / t.step_s / 1e9,
                "pred_d2h_gbps": t.d2h_bytes / t.step_s / 1e9,
                "pred_gpu_idle_fraction": tl.gpu_idle_fraction if tl is not None else None,
                "pred_hardware": hw, "pred_link_gbps": link}
    except Exception as exc:  # noqa: BLE001 - the measurement stands without it; the reason is kept
        return {"pred_error": f"{type(exc).__name__}: {exc}"[:300]}


def _err_pct(measured: Any, predicted: Any) -> float | None:
    if measured is None or predicted is None or not measured:
        return None
    return round(100.0 * (predicted - measured) / measured, 1)


def _compute_busy_s(records: list[Any]) -> float:
    spans = sorted((r.t_start, r.t_end) for r in records if r.stream == "compute")
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        if b <= end:
            continue
        busy += b - max(a, end)
        end = b
    return busy


def _run_engine(pt: BenchPoint, cfg: Any, ctx: Ctx, until: float, steps_cap: int | None) -> dict[str, Any]:
    import torch

    from megatrain.config.schema import EngineConfig
    from megatrain.engine import Engine

    t0 = time.perf_counter()
    model = build_model(cfg)
    eng = Engine(model, EngineConfig(device=str(ctx.device), residency=pt.residency, trace=True,
                                     parity_probe=False))
    del model
    batch = _batch(cfg, pt.seq, "cpu")

    def step() -> float:
        out = eng(**batch)
        eng.backward(out.loss)
        eng.clip_grad_norm_(1.0)
        eng.step()
        eng.zero_grad()
        return float(out.loss.detach())

    step()  # warm-up: first-touch allocations, kernels picked
    eng.synchronize()
    build_s = time.perf_counter() - t0
    times, rows = [], []
    while len(times) < MIN_STEPS or (time.perf_counter() < until and (steps_cap is None or len(times) < steps_cap)):
        eng.reset_stats()
        s0 = time.perf_counter()
        loss = step()
        eng.synchronize()
        _sync(ctx.device)
        dt = time.perf_counter() - s0
        st = eng.collect_stats()
        times.append(dt)
        trace = eng.trace
        rows.append((dt, st, _compute_busy_s(trace), loss, trace))
        if not torch.isfinite(torch.tensor(loss)):
            raise RuntimeError(f"non-finite loss {loss} at timed step {len(times)}")
    med = statistics.median(times)
    dt, st, busy, _, trace = min(rows, key=lambda r: abs(r[0] - med))  # the median step's own counts
    trace_file = Path("traces") / f"{pt.name}.json"
    (ctx.out / "traces").mkdir(parents=True, exist_ok=True)
    (ctx.out / trace_file).write_text(json.dumps(
        {"point": pt.name, "step_s": dt, "records": [[r.stream, r.kind, r.layer, r.t_start, r.t_end] for r in trace]}))
    return {"trace_file": str(trace_file),
        "steps": len(times), "step_time_s": med, "step_time_min_s": min(times), "build_s": round(build_s, 1),
        "h2d_bytes_per_step": st["h2d_bytes"], "d2h_bytes_per_step": st["d2h_bytes"],
        "h2d_gbps": st["h2d_bytes"] / dt / 1e9, "d2h_gbps": st["d2h_bytes"] / dt / 1e9,
        "h2d_gbps_busy": st["h2d_bytes"] / st["h2d_busy_s"] / 1e9 if st.get("h2d_busy_s") else None,
        "d2h_gbps_busy": st["d2h_bytes"] / st["d2h_busy_s"] / 1e9 if st.get("d2h_busy_s") else None,
        "gpu_idle_fraction": max(0.0, 1.0 - busy / dt) if busy else None,
        "speculative_layers": st.get("speculative_layers"),
        "speculative_rollbacks": st.get("speculative_rollbacks"),
        "resident_weight_layers": st.get("resident_weight_layers"),
        "peak_device_bytes": st.get("peak_device_bytes"),
    }


def _run_torch(pt: BenchPoint, cfg: Any, ctx: Ctx, until: float, steps_cap: int | None) -> dict[str, Any]:
    """Plain PyTorch: FP32 weights on the device, bf16 autocast (fp32 on the CPU dry run), fused AdamW, clip 1."""
    import torch

    t0 = time.perf_counter()
    dev = str(ctx.device)
    model = build_model(cfg, device=dev)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, **({"fused": True} if ctx.cuda else {}))
    batch = _batch(cfg, pt.seq, dev)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if ctx.cuda else torch.autocast("cpu", enabled=False)

    def step() -> torch.Tensor:
        with amp:
            loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    step()
    _sync(ctx.device)
    build_s = time.perf_counter() - t0
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    while len(times) < MIN_STEPS or (time.perf_counter() < until and (steps_cap is None or len(times) < steps_cap)):
        s0 = time.perf_counter()
        loss = step()
        _sync(ctx.device)
        times.append(time.perf_counter() - s0)
        if not torch.isfinite(loss):
            raise RuntimeError(f"non-finite loss {float(loss)}")
    return {"steps": len(times), "step_time_s": statistics.median(times), "step_time_min_s": min(times),
            "build_s": round(build_s, 1),
            "peak_device_bytes": torch.cuda.max_memory_allocated() if ctx.cuda else None}


def _flops(cfg: Any, tokens: int) -> float:
    """6 N T plus attention's 12 L h T^2 / 2 (causal), N the non-embedding parameters."""
    h, f, n_layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    n = n_layers * (4 * h * h + 3 * h * f) + h * cfg.vocab_size  # the head's matmul computes too
    return 6.0 * n * tokens + 6.0 * n_layers * h * tokens * tokens


def append_row(path: Path, row: dict[str, Any]) -> None:
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerow(row)


def read_rows(path: Path) -> list[dict[str, Any]]:
    """results.csv's rows, numbers as floats, empty cells as None."""
    if not path.exists():
        return []
    out = []
    with path.open(newline="") as f:
        for r in csv.DictReader(f):
            row: dict[str, Any] = {}
            for k, v in r.items():
                if v == "":
                    row[k] = None
                    continue
                try:
                    row[k] = float(v) if any(c in v for c in ".eE") or v.lstrip("-").isdigit() else v
                except ValueError:
                    row[k] = v
            out.append(row)
    return out


def phase_bench(ctx: Ctx) -> None:
    import gc

    import torch

    csv_path = ctx.out / "results.csv"
    cfg = model_config(ctx.dry)
    points = bench_points(ctx.dry)
    link = _link_gbps(ctx)
    ctx.info(link_h2d_gbps=link, hardware_profile=hardware_profile(ctx), layers=cfg.num_hidden_layers,
             hidden=cfg.hidden_size, seq=points[0].seq, budget_s=round(ctx.deadline - ctx.started, 1))
    for i, pt in enumerate(points):
        left = ctx.deadline - time.time() - 2.0
        # an equal share of what is left for this point and those after it; the dry run takes a few steps
        share = left / (len(points) - i)
        until = time.perf_counter() + max(0.0, share - (0 if ctx.dry else BUILD_ALLOWANCE_S))
        cap = DRY_STEPS if ctx.dry else None

        def one(pt: BenchPoint = pt, until: float = until, cap: int | None = cap) -> dict[str, Any]:
            run = _run_engine if pt.backend == "megatrain" else _run_torch
            base = {"point": pt.name, "backend": pt.backend, "residency": pt.residency, "layers": pt.layers,
                    "hidden": pt.hidden, "seq_len": pt.seq, "micro_batch": 1, "device": str(ctx.device),
                    # what an earlier point left allocated on the device (a lingering engine shows here)
                    "device_bytes_before": torch.cuda.memory_allocated() if ctx.cuda else None}
            try:
                got = run(pt, cfg, ctx, until, cap)
            except Exception as exc:
                append_row(csv_path, {**base, "status": "failed", "reason": f"{type(exc).__name__}: {exc}"[:300]})
                raise
            finally:
                gc.collect()
                if ctx.cuda:
                    torch.cuda.empty_cache()
            flops = _flops(cfg, pt.seq)
            got.update(tokens_per_s=pt.seq / got["step_time_s"], model_tflops=flops / got["step_time_s"] / 1e12)
            pred = predict(pt, cfg, ctx, link)
            got.update(pred)
            got.update(err_step_pct=_err_pct(got["step_time_s"], pred.get("pred_step_time_s")))
            if pt.backend == "megatrain":
                got.update(err_h2d_pct=_err_pct(got.get("h2d_gbps"), pred.get("pred_h2d_gbps")),
                           err_d2h_pct=_err_pct(got.get("d2h_gbps"), pred.get("pred_d2h_gbps")),
                           err_idle_pct=_err_pct(got.get("gpu_idle_fraction"), pred.get("pred_gpu_idle_fraction")))
            append_row(csv_path, {**base, "status": "ok", "reason": "", **got})
            _log(f"  bench.{pt.name}: {got['step_time_s']:.3f} s/step over {got['steps']} steps "
                 f"(predicted {pred.get('pred_step_time_s') or float('nan'):.3f})")
            return {"ok": True, **base, **got}

        ctx.check(pt.name, one)
    rows = {r["point"]: r for r in read_rows(csv_path) if r.get("status") == "ok"}
    if "torch" in rows and "stream" in rows:
        ctx.info(stream_vs_torch=rows["stream"]["step_time_s"] / rows["torch"]["step_time_s"])


def bench_model_bytes(dry: bool) -> int:
    """FP32 bytes of the bench's model (the host holds it while the engine builds; the device for PyTorch)."""
    import torch

    with torch.device("meta"):
        import transformers

        m = transformers.LlamaForCausalLM(model_config(dry))
    return 4 * sum(p.numel() for p in m.parameters())
