"""Data-parallel scaling: measured on this machine, and predicted by the planner for GPU nodes.

    python -m experiments.studies.scaling --out results/scaling              # measured.csv: 1 and 2 ranks here
    python -m experiments.studies.scaling --predict --out results/scaling    # predicted.csv: 8-GPU nodes, 1-4 nodes

Measured: a small preset trained with the megatrain engine for a few steps, once per world size, each
launched with torch.distributed.run on the CPU (gloo; one thread per rank; optionally an emulated link).
Every rank records its median step time and, after its last step while every rank is still alive (a
barrier on each side), its PSS and RSS from /proc/self/smaps_rollup, and its PSS before the model was
built (the process baseline: python, torch, transformers, the engine). A row per world size: job
tokens/s, the slowest rank's step, and the SUM over ranks of PSS (pages two ranks share are counted once
in that sum; RSS would count them twice), with RSS for reference, and the planner's node figure for the
same point (cpu profile, planner/multi.py: one host store per node) beside it.

Predicted: plan_multi for 1, 2, 4, 8 GPUs per node x 1, 2, 4 nodes on the 8-GPU node profiles, for a
7B-class and a 120B-class preset (the latter in the exact 12 B/param host mode, the one that fits 120B).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_WORLDS = (1, 2)
# 120B fits an H200 node's 1.5 TB only in this mode (hilo master, optimizer in backward, no clipping)
EXACT_12B = {"master": "hilo", "optimizer_in_backward": True, "grad_clip": False}
PREDICT_HARDWARE = ("h100-sxm", "h200-pcie")
PREDICT_MODELS = (("llama2-7b", {}), ("dense-120b", EXACT_12B))
PREDICT_GPUS = (1, 2, 4, 8)
PREDICT_NODES = (1, 2, 4)
# The packaged `cpu` profile's rates were measured with this many torch threads (its description): a rank of
# `threads` threads gets that share of them when the measured rows are predicted.
CPU_PROFILE_THREADS = 2


# ---------------------------------------------------------------------------------------- one rank


def _worker(cfg: dict[str, Any]) -> None:
    """One rank of a measured point (started by torch.distributed.run): writes rank{r}.json to cfg['dir']."""
    import torch
    import torch.distributed as dist
    import transformers  # noqa: F401 - imported before the baseline is read: it is part of every rank's runtime

    from experiments.point import build_preset_model
    from megatrain.config.schema import EngineConfig
    from megatrain.engine import Engine
    from megatrain.metrics.pss import memory_rollup
    from megatrain.models.presets import get_preset

    torch.set_num_threads(cfg["threads"])
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    base = memory_rollup()
    preset = get_preset(cfg["model"])
    model = build_preset_model(preset, seed=0)
    eng = Engine(model, config=EngineConfig(device="cpu", parity_probe=False, link_gbps=cfg["link_gbps"],
                                            watchdog_s=300.0))
    del model
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own micro-batch
    times = []
    for i in range(cfg["warmup"] + cfg["steps"]):
        ids = torch.randint(0, preset.vocab, (cfg["micro_batch"], cfg["seq_len"]), generator=gen)
        t0 = time.perf_counter()
        loss = eng(input_ids=ids, labels=ids).loss
        eng.backward(loss)
        eng.step()
        eng.zero_grad()
        eng.synchronize()
        if i >= cfg["warmup"]:
            times.append(time.perf_counter() - t0)
    if world > 1:
        dist.barrier()  # every rank has trained before any reads its memory...
    end = memory_rollup()
    if world > 1:
        dist.barrier()  # ...and none exits (unmapping what it shares) before all have read theirs
    rec = {"rank": rank, "world_size": world, "step_times_s": times, "step_s": statistics.median(times),
           "loss_last": float(loss.detach()), "pss_bytes": end["Pss"], "rss_bytes": end["Rss"],
           "baseline_pss_bytes": base["Pss"], "baseline_rss_bytes": base["Rss"], "params": preset.param_count()}
    Path(cfg["dir"], f"rank{rank}.json").write_text(json.dumps(rec))


# ---------------------------------------------------------------------------------------- measured


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, cfg: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
    """Run one point on `world` ranks of this machine; the ranks' records, in rank order."""
    with tempfile.TemporaryDirectory(prefix="scaling-") as d:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
               "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
               "-m", "experiments.studies.scaling", "--worker", json.dumps({**cfg, "dir": d})]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": str(cfg["threads"])}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(f"{world} rank(s) failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        return [json.loads(Path(d, f"rank{r}.json").read_text()) for r in range(world)]


def measured_row(recs: list[dict[str, Any]], cfg: dict[str, Any]) -> dict[str, Any]:
    """One results row from the ranks' records, with the planner's prediction for the same point."""
    from megatrain.planner import get_hardware, plan_multi

    world = len(recs)
    step = max(r["step_s"] for r in recs)  # the job moves at its slowest rank
    tokens = world * cfg["micro_batch"] * cfg["seq_len"]
    cpu = get_hardware("cpu")
    share = min(world * cfg["threads"], os.cpu_count() or 1) / CPU_PROFILE_THREADS  # rank_hardware splits it by world
    cpu = cpu.with_(peak_fp32_tflops=cpu.peak_fp32_tflops * share, peak_bf16_tflops=cpu.peak_bf16_tflops * share)
    pred = plan_multi(cfg["model"], cfg["seq_len"], cfg["micro_batch"], dtype="float32", hardware=cpu,
                      gpus_per_node=world, link_gbs=cfg["link_gbps"])
    return {
        "source": "measured", "model": cfg["model"], "params": recs[0]["params"], "world_size": world,
        "seq_len": cfg["seq_len"], "micro_batch": cfg["micro_batch"], "precision": "fp32",
        "warmup_steps": cfg["warmup"], "timed_steps": cfg["steps"], "threads_per_rank": cfg["threads"],
        "link_gbps": cfg["link_gbps"], "tokens_per_step": tokens,
        "rank_step_s": step, "rank_step_times_s": json.dumps([r["step_s"] for r in recs]),
        "tokens_per_s": tokens / step,
        "pss_sum_bytes": sum(r["pss_bytes"] for r in recs), "rss_sum_bytes": sum(r["rss_bytes"] for r in recs),
        "baseline_pss_sum_bytes": sum(r["baseline_pss_bytes"] for r in recs),
        "baseline_rss_sum_bytes": sum(r["baseline_rss_bytes"] for r in recs),
        "rank_pss_bytes": json.dumps([r["pss_bytes"] for r in recs]),
        "loss_last": json.dumps([round(r["loss_last"], 4) for r in recs]),
        "predicted_host_node_bytes": pred.host_node_bytes, "predicted_tokens_per_s": pred.job_tokens_per_s,
    }


def run_measured(worlds: tuple[int, ...], cfg: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
    from megatrain.metrics.provenance import provenance

    prov = provenance()
    rows = []
    for w in worlds:
        t0 = time.perf_counter()
        row = measured_row(launch(w, cfg, timeout_s), cfg)
        print(f"{w} rank(s): {row['tokens_per_s']:.1f} tokens/s, step {row['rank_step_s']:.2f} s, "
              f"PSS sum {row['pss_sum_bytes'] / 2**30:.2f} GiB, RSS sum {row['rss_sum_bytes'] / 2**30:.2f} GiB "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        rows.append({**row, **prov})
    one = next((r["tokens_per_s"] for r in rows if r["world_size"] == 1), None)
    for r in rows:  # job tokens/s over world x one rank's, as the planner's scaling efficiency
        r["scaling_efficiency"] = r["tokens_per_s"] / (r["world_size"] * one) if one else None
    return rows


# ---------------------------------------------------------------------------------------- predicted


def predict_rows(hardware: tuple[str, ...] = PREDICT_HARDWARE, models=PREDICT_MODELS,
                 gpus: tuple[int, ...] = PREDICT_GPUS, nodes: tuple[int, ...] = PREDICT_NODES,
                 context: int = 4096, batch: int = 8) -> list[dict[str, Any]]:
    """The planner's data-parallel figures for every (hardware, model, GPUs per node, nodes)."""
    from megatrain.metrics.provenance import git_commit, package_versions, utc_now
    from megatrain.planner import get_hardware, plan_multi

    commit, dirty = git_commit()
    prov = {"git_commit": commit, "git_dirty": dirty, "versions": package_versions(), "timestamp": utc_now()}
    rows = []
    for hw in hardware:
        prof = get_hardware(hw)
        for model, knobs in models:
            for n in gpus:
                for m in nodes:
                    mp = plan_multi(model, context, batch, hardware=hw, gpus_per_node=n, nodes=m, **knobs)
                    rows.append({"source": "predicted", "hardware": hw, "hardware_description": prof.description,
                                 "model": model, "params": mp.rank.point.model.param_count(),
                                 "host_mode": json.dumps(knobs) if knobs else "default", "seq_len": context,
                                 "micro_batch": batch, "precision": "bf16",
                                 "host_node_capacity_bytes": prof.host_bytes, "network_gbs": prof.network_gbs,
                                 **mp.summary(), **prov})
    return rows


# ---------------------------------------------------------------------------------------- files


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.studies.scaling", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "scaling")
    ap.add_argument("--predict", action="store_true", help="write predicted.csv from the planner instead")
    ap.add_argument("--model", default="llama-100m", help="preset to train (measured)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=1, help="rows per rank")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--link-gbps", type=float, default=None, help="emulate a host link of this rate (engine link_gbps)")
    ap.add_argument("--worlds", default=",".join(map(str, DEFAULT_WORLDS)), help="world sizes to run, comma list")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per world size")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # one rank's config (JSON), from launch()
    args = ap.parse_args(argv)
    if args.worker:
        _worker(json.loads(args.worker))
        return 0
    if args.predict:
        rows = predict_rows()
        write_csv(rows, args.out / "predicted.csv")
        print(f"{len(rows)} predicted rows -> {args.out / 'predicted.csv'}")
        return 0
    cfg = {"model": args.model, "seq_len": args.seq_len, "micro_batch": args.micro_batch, "steps": args.steps,
           "warmup": args.warmup, "threads": args.threads, "link_gbps": args.link_gbps}
    worlds = tuple(int(w) for w in args.worlds.split(",") if w.strip())
    rows = run_measured(worlds, cfg, args.timeout_s)
    write_csv(rows, args.out / "measured.csv")
    print(f"{len(rows)} measured rows -> {args.out / 'measured.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
