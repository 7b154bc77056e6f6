"""Soak benchmark (issue 5; a benchmark, not a test): does a long run leak host or device memory?

    python -m experiments.studies.soak                      # 2,000 steps, writes results/soak/result.json
    python -m experiments.studies.soak --steps 500 --out /tmp/soak.json

Trains a small Llama through `megatrain.initialize` (the DeepSpeed face: clipping, LR schedule,
gradient accumulation) for N optimizer steps with varying sequence lengths, a checkpoint every
`--ckpt-every` steps (keep_last=2) and, optionally, an injected non-finite loss every
`--nonfinite-every` steps (exercising the skip path). After every step it records

* host RSS (/proc/self/statm),
* device accounting: on CUDA `torch.cuda.memory_allocated` after the step and the step's
  `max_memory_allocated`; on a CPU "device" the engine's own tracker (`measure_device_memory`):
  bytes still live after the step, and the step's measured peak. The tracker costs ~5x a step, so
  by default it runs on every 20th step (a storage allocated in a tracked step stays counted until
  it is freed, so a per-step leak still shows),

and reports growth from step `--warmup` (default 100, after allocator caches have settled) to the
end, both end-to-end and as a least-squares slope, plus the skipped-step count. Target: < 1 %.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def provenance() -> dict[str, Any]:
    from megatrain.metrics.provenance import provenance as common

    return {**common(), "threads": torch.get_num_threads(), "load_avg_at_start": os.getloadavg()}


def slope_per_step(xs: list[int], ys: list[float]) -> float:
    """Least-squares slope: one noisy sample at the end says less than the trend over all of them."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def growth(series: list[float], steps: list[int], warmup: int) -> dict[str, float]:
    """From the step-`warmup` sample to the end: absolute, relative, and the fitted trend over the span."""
    i0 = next(i for i, s in enumerate(steps) if s >= warmup)
    xs, ys = steps[i0:], series[i0:]
    start, end = ys[0], ys[-1]
    slope = slope_per_step(xs, ys)
    span = xs[-1] - xs[0]
    return {"at_warmup": start, "at_end": end, "max_after_warmup": max(ys), "growth": end - start,
            "growth_pct": 100.0 * (end - start) / start if start else 0.0,
            "trend_per_step": slope, "trend_over_run_pct": 100.0 * slope * span / start if start else 0.0}


def peak_growth_by_shape(peaks: list[float], steps: list[int], shapes: list[str], warmup: int) -> dict[str, Any]:
    """Step peaks grouped by the step's sequence lengths (micro-batch seqs joined by 'x'), growth per group."""
    per = {}
    for shape in sorted(set(shapes)):
        idx = [i for i, sh in enumerate(shapes) if sh == shape and steps[i] >= warmup]
        if len(idx) >= 2:
            per[shape] = growth([peaks[i] for i in idx], [steps[i] for i in idx], warmup)
    worst = max(per.values(), key=lambda g: abs(g["growth_pct"]), default=None)
    return {"per_shape": per, "worst_growth_pct": worst["growth_pct"] if worst else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000, help="optimizer steps")
    ap.add_argument("--warmup", type=int, default=100, help="growth is measured from this step to the end")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seqs", default="32,48,64", help="sequence lengths, cycled")
    ap.add_argument("--accum", type=int, default=2, help="gradient accumulation steps")
    ap.add_argument("--ckpt-every", type=int, default=500, help="0: never checkpoint")
    ap.add_argument("--nonfinite-every", type=int, default=0, help="inject a NaN loss every N steps (0: never)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default=None, help="default: the accelerator if there is one, else cpu")
    ap.add_argument("--measure-every", type=int, default=20,
                    help="CPU: run the op-by-op device tracker on every N-th step (it costs ~5x a step); 0: never, "
                         "the device accounting is then the engine's analytic count")
    ap.add_argument("--out", default=str(ROOT / "results" / "soak" / "result.json"))
    args = ap.parse_args(argv)
    if args.warmup >= args.steps:
        ap.error("--warmup must be below --steps")
    if args.measure_every < 0:
        ap.error("--measure-every must be >= 0")

    torch.set_num_threads(args.threads)
    import transformers

    import megatrain

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                                   num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=args.vocab, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    on_cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    ds = {
        "train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": args.accum,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": args.steps, "warmup_num_steps": 50}},
        # On a CPU "device" the engine measures live tensor bytes op by op: the device accounting to watch.
        "megatrain": {"device": args.device, "measure_device_memory": not on_cuda and args.measure_every > 0},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = megatrain.initialize(model=model, config=ds)
    del model
    inner = engine.engine
    seqs = [int(s) for s in args.seqs.split(",")]
    g = torch.Generator().manual_seed(1)
    ckpt_dir = Path(tempfile.mkdtemp(prefix="megatrain-soak-"))

    # The tracker wraps the engine's forward/backward; between sampled steps the plain methods run. A
    # storage allocated in a sampled step stays counted until freed, so a per-step leak still shows.
    tracked = (inner.forward, inner.backward)
    plain = (type(inner).forward.__get__(inner), type(inner).backward.__get__(inner))
    steps, rss, dev_steps, dev_live, dev_peak, losses, step_s = [], [], [], [], [], [], []
    dev_shape: list[str] = []  # a step's peak depends on its sequence lengths: compare like with like
    skipped_warnings = 0
    t_start = time.perf_counter()
    micro = 0
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        sample = on_cuda or (inner.memory is not None and (step % args.measure_every == 0 or step == args.steps))
        if inner.memory is not None:
            inner.forward, inner.backward = tracked if sample else plain
        inner.reset_stats()
        if on_cuda:
            torch.cuda.reset_peak_memory_stats()
        shape = "x".join(str(seqs[(micro + i) % len(seqs)]) for i in range(args.accum))
        for _ in range(args.accum):
            seq = seqs[micro % len(seqs)]
            micro += 1
            ids = torch.randint(0, args.vocab, (args.batch, seq), generator=g)
            out = engine(input_ids=ids, labels=ids)
            loss = out.loss
            if args.nonfinite_every and step % args.nonfinite_every == 0:
                loss = loss * float("nan")
            engine.backward(loss)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine.step()
            skipped_warnings += sum("step skipped" in str(w.message) for w in caught)
        losses.append(float(out.loss.item()))
        del out, loss  # the script's own references would keep the last loss graph alive and counted
        if args.ckpt_every and step % args.ckpt_every == 0:
            engine.save_checkpoint(ckpt_dir, keep_last=2)
        stats = inner.collect_stats()
        steps.append(step)
        rss.append(rss_bytes())
        if on_cuda:
            torch.cuda.synchronize()
            dev_steps.append(step)
            dev_shape.append(shape)
            dev_live.append(torch.cuda.memory_allocated())
            dev_peak.append(torch.cuda.max_memory_allocated())
        elif sample or inner.memory is None:
            dev_steps.append(step)
            dev_shape.append(shape)
            dev_live.append(inner.device_weight_bytes + (inner.memory.live if inner.memory else 0))
            dev_peak.append(stats["peak_device_bytes"])
        step_s.append(time.perf_counter() - t0)
        if step % 100 == 0 or step == args.steps:
            print(f"step {step:5d}  loss {losses[-1]:.4f}  rss {rss[-1] / 2**20:8.1f} MiB  device live "
                  f"{dev_live[-1] / 2**20:7.2f} MiB  peak {dev_peak[-1] / 2**20:7.2f} MiB  "
                  f"{statistics.median(step_s[-100:]) * 1e3:6.1f} ms/step", flush=True)
    wall = time.perf_counter() - t_start

    result = {
        "what": "soak: host RSS and device-accounting growth over a long run (issue 5)",
        "config": {**vars(args), "params": n_params, "device": str(inner.device),
                   "device_accounting": "torch.cuda.memory_allocated / max_memory_allocated" if on_cuda else
                   f"engine tracker (measure_device_memory) on every {args.measure_every}th step: live bytes "
                   "after the step, measured step peak" if args.measure_every else "engine analytic count"},
        "steps_run": args.steps,
        "skipped_steps": engine.skipped_steps,
        "skipped_step_warnings": skipped_warnings,
        "host_rss_bytes": growth(rss, steps, args.warmup),
        "device_live_bytes": growth(dev_live, dev_steps, args.warmup),
        "device_step_peak_bytes": peak_growth_by_shape(dev_peak, dev_steps, dev_shape, args.warmup),
        "loss": {"first": losses[0], "at_warmup": losses[args.warmup - 1], "last": losses[-1]},
        "time": {"wall_s": wall, "median_step_s": statistics.median(step_s)},
        "samples_every_50_steps": {"step": steps[::50], "rss_mib": [r / 2**20 for r in rss[::50]],
                                   "device_step": dev_steps[:: max(1, 50 // max(1, args.measure_every))],
                                   "device_live_mib": [d / 2**20 for d in dev_live[:: max(1, 50 // max(1, args.measure_every))]]},
        "provenance": provenance(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    h, d = result["host_rss_bytes"], result["device_live_bytes"]
    print(f"host RSS: {h['at_warmup'] / 2**20:.1f} -> {h['at_end'] / 2**20:.1f} MiB ({h['growth_pct']:+.2f} %, "
          f"trend {h['trend_over_run_pct']:+.2f} %); device live: {d['growth_pct']:+.2f} %; "
          f"skipped steps {engine.skipped_steps}; wrote {out}")
    import shutil

    shutil.rmtree(ckpt_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
