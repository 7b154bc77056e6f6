"""How long the launch thread is held up per step with optimizer_overlap on (a benchmark, not a test; its result is
committed under results/host_passes/launch.md).

    python -m experiments.studies.host_passes_launch [--preset llama-100m] [--context 256] [--gbps 8] [--steps 6]

The engine runs on the CPU with its copy engine rate-limited to `--gbps` (EngineConfig(link_gbps=...)) and the host
update overlapped with the next forward, as on a GPU. N consecutive steps (forward, backward, clip, step, zero_grad)
are timed as one span and drained inside it (the optimizer thread's queued layers count). Per step, from the
engine's own counters and trace:

- blocked: the launch (compute) thread waiting on the copy streams (`copy_wait_s`: a layer load that waits for the
  link, or for the layer's update on the optimizer thread);
- step(): what step() held the launch thread (its wait for the previous step's jobs, the resident update);
- compute: the trace's compute spans (forward and backward of the layers).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from pathlib import Path


def measure(preset, context: int, gbps: float, steps: int, warmup: int = 2) -> dict:
    import torch

    from experiments.point import build_preset_model
    from megatrain.config.schema import EngineConfig
    from megatrain.engine import Engine

    cfg = EngineConfig(device="cpu", link_gbps=gbps, optimizer_overlap=True, trace=True, parity_probe=False)
    eng = Engine(build_preset_model(preset, 0), cfg)
    x = torch.randint(0, preset.vocab, (1, context), generator=torch.Generator().manual_seed(1))

    def one() -> None:
        out = eng(input_ids=x, labels=x)
        eng.backward(out.loss)
        eng.clip_grad_norm_(1.0)
        eng.step()
        eng.zero_grad()

    for _ in range(warmup):
        one()
    eng.synchronize()
    eng.reset_stats()
    n_before = len(eng.trace)
    t0 = time.perf_counter()
    for _ in range(steps):
        one()
    eng.synchronize()  # the last step's queued layer updates, inside the clock
    wall = time.perf_counter() - t0
    st = eng.collect_stats()
    compute = sum(r.t_end - r.t_start for r in eng.trace[n_before:] if r.stream == "compute")
    optimizer = sum(r.t_end - r.t_start for r in eng.trace[n_before:] if r.stream == "optimizer")
    step = wall / steps
    return {"step_s": step, "blocked_s": st["copy_wait_s"] / steps, "step_call_s": st["optimizer_s"] / steps,
            "compute_s": compute / steps, "optimizer_thread_s": optimizer / steps,
            "blocked_pct": 100 * st["copy_wait_s"] / steps / step,
            "step_call_pct": 100 * st["optimizer_s"] / steps / step, "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    from megatrain.models.presets import get_preset

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-100m")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--gbps", type=float, nargs="+", default=[4.0, 16.0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default="results/host_passes/launch.md")
    a = ap.parse_args(argv)
    preset = get_preset(a.preset)
    rows = [(g, measure(preset, a.context, g, a.steps)) for g in a.gbps]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = ["# The launch thread's blocked time per step, optimizer_overlap on, emulated link", "",
             "Written by `python -m experiments.studies.host_passes_launch` (its docstring says what is timed).", "",
             f"- preset: {a.preset}, 1 x {a.context} tokens, {a.steps} consecutive steps timed and drained as one span",
             f"- machine: {os.cpu_count()} cores, torch threads {rows[0][1]['threads']}, load "
             f"{os.getloadavg()[0]:.1f} (a shared box)",
             f"- commit: {commit}", "",
             "| link GB/s | step s | blocked s | blocked % | step() s | step() % | compute s | optimizer thread s |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for g, r in rows:
        lines.append(f"| {g:g} | {r['step_s']:.3f} | {r['blocked_s']:.4f} | {r['blocked_pct']:.1f} | "
                     f"{r['step_call_s']:.4f} | {r['step_call_pct']:.1f} | {r['compute_s']:.3f} | "
                     f"{r['optimizer_thread_s']:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
