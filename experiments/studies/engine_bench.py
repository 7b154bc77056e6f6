"""Engine figures for the closing note (a benchmark, not a test).

    python -m experiments.studies.engine_bench rss   --preset llama-0.6b   # peak host RSS growth per parameter
    python -m experiments.studies.engine_bench rss --engine '{"compute_dtype": "bfloat16", "host_master": "hilo"}'
    python -m experiments.studies.engine_bench ratio --preset llama-100m   # streaming engine vs PyTorch + checkpointing
    python -m experiments.studies.engine_bench fits --preset llama-100m    # engine's defaults vs plain PyTorch
    python -m experiments.studies.engine_bench overlap --preset llama-100m # optimizer_overlap on vs off

`rss` runs in its own process so its peak RSS is its own. `ratio` times both backends in one process,
interleaved, with the same FLOPs (HF gradient checkpointing on for PyTorch; the engine streams and recomputes
each layer, `residency: "stream"`), and reports the median ratio: timings on shared machines are noisy, ratios
less so. `fits` is what a user whose model fits runs: plain PyTorch without checkpointing against the engine with
its defaults (residency "auto": every layer kept, nothing recomputed), FP32, fused AdamW on both sides, each in
a process of its own, alternated over rounds.
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import statistics
import time
from pathlib import Path

import torch

from megatrain.metrics.samplers import peak_rss_bytes


def _rss_now_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _batch(vocab: int, batch: int, seq: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def timed_steps(eng, batch: dict, steps: int) -> list[float]:
    """Seconds of each of `steps` full training steps (forward, backward, step, zero_grad) on `batch`."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.backward(eng(**batch).loss)
        eng.step()
        eng.zero_grad()
        times.append(time.perf_counter() - t0)
    return times


def _provenance() -> dict:
    from megatrain.metrics.provenance import provenance

    return {**provenance(), "threads": torch.get_num_threads()}


def bench_rss(preset: str, seq: int, steps: int, engine: dict | None = None) -> dict:
    """Peak RSS growth over the post-import baseline, per parameter, while training on the engine
    (`engine`: extra EngineConfig settings, e.g. a host-memory mode)."""
    import transformers

    from megatrain.config.schema import EngineConfig
    from megatrain.engine import Engine
    from megatrain.models.presets import get_preset

    p = get_preset(preset)
    base = _rss_now_bytes()
    model = transformers.AutoModelForCausalLM.from_config(p.hf_config())
    eng = Engine(model, EngineConfig(device="cpu", **(engine or {})))
    del model
    n = sum(g.numel for g in eng.store.groups())
    times = timed_steps(eng, _batch(p.vocab, 1, seq), steps)
    peak = peak_rss_bytes() - base
    return {"preset": preset, "engine": engine or {}, "params": n, "seq": seq, "steps": steps,
            "peak_rss_growth_bytes": peak,
            "bytes_per_param": peak / n, "host_store_bytes_per_param": eng.store.host_bytes() / n,
            "step_s": times}


def bench_ratio(preset: str, seq: int, batch: int, steps: int) -> dict:
    """Median step time of the engine / plain PyTorch (gradient checkpointing), interleaved."""
    import transformers

    from megatrain.config.schema import EngineConfig
    from megatrain.engine import Engine
    from megatrain.models.presets import get_preset

    p = get_preset(preset)
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(p.hf_config())
    eng = Engine(copy.deepcopy(ref), EngineConfig(device="cpu", residency="stream"))
    ref.gradient_checkpointing_enable()
    ref.config.use_cache = False
    ref.train()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-4, fused=True)
    data = _batch(p.vocab, batch, seq)

    def torch_step() -> float:
        t0 = time.perf_counter()
        ref(**data).loss.backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0

    def engine_step() -> float:
        t0 = time.perf_counter()
        eng.backward(eng(**data).loss)
        eng.step()
        eng.zero_grad()
        return time.perf_counter() - t0

    torch_step(), engine_step()  # warm-up: allocator, optimizer state
    eng.reset_stats()
    t_torch, t_eng = [], []
    for _ in range(steps):
        t_torch.append(torch_step())
        t_eng.append(engine_step())
    stats = eng.collect_stats()
    ratio = statistics.median(t_eng) / statistics.median(t_torch)
    return {"preset": preset, "seq": seq, "batch": batch, "steps": steps, "torch_s": t_torch, "engine_s": t_eng,
            "ratio_engine_over_torch": ratio, "engine_copy_wait_s_total": stats["copy_wait_s"],
            "engine_h2d_bytes_per_step": stats["h2d_bytes"] / steps}


def _fits_model(backend: str, preset: str, seq: int, batch: int):
    """The model (or engine) a user whose model fits trains, its batch, and one timed step: `torch` (plain, no
    checkpointing) or `megatrain` (the engine's defaults), FP32, fused AdamW on both sides."""
    import transformers

    from megatrain.config.schema import EngineConfig
    from megatrain.engine import Engine
    from megatrain.models.presets import get_preset

    p = get_preset(preset)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(p.hf_config())
    model.config.use_cache = False
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    if backend == "megatrain":
        model = Engine(model, EngineConfig(device="cpu", compute_dtype="float32"), optimizer=opt)
    data = _batch(p.vocab, batch, seq)
    stepper = model if backend == "megatrain" else opt

    def step() -> tuple[list[float], float]:
        """(seconds of the forward, the backward and the update with zero_grad), the loss."""
        t0 = time.perf_counter()
        loss = model(**data).loss
        value = loss.item()
        t1 = time.perf_counter()
        if backend == "megatrain":
            model.backward(loss)
        else:
            loss.backward()
        t2 = time.perf_counter()
        stepper.step()
        stepper.zero_grad()
        return [t1 - t0, t2 - t1, time.perf_counter() - t2], value

    return model, step


def fits_serve(backend: str, preset: str, seq: int, batch: int, warmup: int) -> None:
    """A child of `fits`: build, run `warmup` steps, say "ready", then time one step per "step" line on stdin
    (a JSON line back each) until "stats" (the engine's counters back, then exit)."""
    import sys

    model, step = _fits_model(backend, preset, seq, batch)
    for _ in range(warmup):  # allocator, optimizer state, and the heap's steady state (the engine's takes longer)
        step()
    if backend == "megatrain":
        model.reset_stats()
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "stats":
            stats = {}
            if backend == "megatrain":
                stats = {k: v for k, v in model.collect_stats().items()
                         if k in ("h2d_bytes", "d2h_bytes", "recomputed_layers", "resident_weight_layers",
                                  "kept_graph_layers", "optimizer_resident_layers")}
            print(json.dumps({"threads": torch.get_num_threads(), **stats}), flush=True)
            return
        phases, loss = step()
        print(json.dumps({"step_s": sum(phases), "phases_s": phases, "loss": loss}), flush=True)


def bench_fits(preset: str, seq: int, batch: int, steps: int, warmup: int = 3, settle_s: float = 0.5) -> dict:
    """Plain PyTorch without checkpointing against the engine's defaults, each backend in a process of its own,
    the two stepped in lockstep: `steps` pairs of consecutive steps (one per process, the order alternated), so
    each engine step is compared with a PyTorch step run next to it in time; the machine's slow drift, which moves
    separate runs by several percent, falls out of the paired ratio. Only one process computes at a time."""
    import subprocess
    import sys

    procs = {}
    for backend in ("torch", "megatrain"):  # built one after the other: neither warm-up shares the cores
        proc = subprocess.Popen([sys.executable, "-m", "experiments.studies.engine_bench", "fits-serve",
                                 "--backend", backend, "--preset", preset, "--seq", str(seq), "--batch", str(batch),
                                 "--warmup", str(warmup)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the {backend} process of the fits benchmark failed before its first timed step")
        procs[backend] = proc

    def ask(backend: str, what: str) -> dict:
        procs[backend].stdin.write(what + "\n")
        procs[backend].stdin.flush()
        return json.loads(procs[backend].stdout.readline())

    runs: dict[str, dict] = {b: {"backend": b, "step_s": [], "phases_s": [], "losses": []} for b in procs}
    for k in range(steps):
        for backend in (("torch", "megatrain") if k % 2 == 0 else ("megatrain", "torch")):
            time.sleep(settle_s)  # the other process's threads parked
            got = ask(backend, "step")
            runs[backend]["step_s"].append(got["step_s"])
            runs[backend]["phases_s"].append(got["phases_s"])
            runs[backend]["losses"].append(got["loss"])
    for backend, proc in procs.items():
        runs[backend].update(ask(backend, "stats"))
        proc.wait()
    for r in runs.values():
        r["median_s"] = statistics.median(r["step_s"])
        # forward (the engine's holds the head's backward: its loss is computed in forward), backward, update
        r["phase_medians_s"] = dict(zip(("forward", "backward", "update"),
                                        (statistics.median(col) for col in zip(*r["phases_s"]))))
    paired = [m / t for m, t in zip(runs["megatrain"]["step_s"], runs["torch"]["step_s"])]
    q = statistics.quantiles(paired, n=4) if len(paired) > 1 else [paired[0]] * 3
    return {"preset": preset, "seq": seq, "batch": batch, "steps": steps, "warmup": warmup, "runs": runs,
            "torch_median_s": runs["torch"]["median_s"], "megatrain_median_s": runs["megatrain"]["median_s"],
            "ratio_engine_over_torch": runs["megatrain"]["median_s"] / runs["torch"]["median_s"],
            "paired_ratios": paired, "paired_ratio_median": statistics.median(paired),
            "paired_ratio_quartiles": [q[0], q[2]]}


def bench_overlap(preset: str, seq: int, batch: int, rounds: int, threads: int = 1, run: int = 3) -> dict:
    """Step time of the engine with the optimizer stepped whole vs overlapped (optimizer_overlap), clipping
    on: each round times `run` consecutive steps per engine (the overlap hides one step's update behind the
    next forward, so steps must follow each other) up to the last update landing; median over rounds,
    the engines interleaved. Their losses must agree bit for bit. On a CPU device the optimizer thread
    needs a core of its own: torch runs `threads` intra-op threads (1 of the 2 here)."""
    from experiments.point import build_preset_model
    from megatrain.config.schema import EngineConfig
    from megatrain.engine import Engine
    from megatrain.models.presets import get_preset

    torch.set_num_threads(threads)
    p = get_preset(preset)
    engines = {ov: Engine(build_preset_model(p, 0), EngineConfig(device="cpu", optimizer_overlap=ov))
               for ov in (False, True)}
    data = _batch(p.vocab, batch, seq)
    per_step: dict[bool, list[float]] = {False: [], True: []}
    losses: dict[bool, list[float]] = {False: [], True: []}
    opt_s = 0.0
    for r in range(rounds + 1):  # round 0 warms up
        for ov, eng in engines.items():
            eng.reset_stats()
            t0 = time.perf_counter()
            for _ in range(run):
                loss = eng(**data).loss
                eng.backward(loss)
                eng.clip_grad_norm_(1.0)
                eng.step()
                eng.zero_grad()
                losses[ov].append(loss.item())
            eng.synchronize()
            if r:
                per_step[ov].append((time.perf_counter() - t0) / run)
                if not ov:
                    opt_s += eng.collect_stats()["optimizer_s"] / (run * rounds)
    if losses[False] != losses[True]:
        raise AssertionError(f"overlap changed the losses: {losses}")
    whole, over = statistics.median(per_step[False]), statistics.median(per_step[True])
    return {"preset": preset, "seq": seq, "batch": batch, "rounds": rounds, "steps_per_round": run,
            "threads": threads, "whole_step_s": per_step[False], "overlap_step_s": per_step[True],
            "speedup_whole_over_overlap": whole / over, "whole_optimizer_s_per_step": opt_s,
            "losses_identical": True}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["rss", "ratio", "fits", "fits-serve", "overlap"])
    ap.add_argument("--backend", choices=["torch", "megatrain"], default="megatrain", help="fits-serve: which")
    ap.add_argument("--preset", default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="results/engine_bench")
    ap.add_argument("--engine", default=None, help="rss: extra EngineConfig settings as JSON")
    ap.add_argument("--name", default=None, help="output file name (default: the benchmark's)")
    ap.add_argument("--warmup", type=int, default=3, help="fits: untimed steps in each process first")
    a = ap.parse_args()
    if a.what == "rss":
        res = bench_rss(a.preset or "llama-0.6b", a.seq or 256, a.steps, json.loads(a.engine) if a.engine else None)
    elif a.what == "ratio":
        res = bench_ratio(a.preset or "llama-100m", a.seq or 512, a.batch, a.steps)
    elif a.what == "fits-serve":  # a child of `fits`: JSON lines on stdout only
        fits_serve(a.backend, a.preset or "llama-100m", a.seq or 512, a.batch, a.warmup)
        return
    elif a.what == "fits":
        res = bench_fits(a.preset or "llama-100m", a.seq or 512, a.batch, a.steps, a.warmup)
    else:
        res = bench_overlap(a.preset or "llama-100m", a.seq or 128, a.batch, a.steps)
    res["provenance"] = _provenance()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.name or a.what}.json").write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
