"""Host memory of data parallel on one machine: what 1 rank, 2 ranks sharing one host store and 2 ranks with
private stores hold together, measured as the SUM of the ranks' PSS (shared pages count once in that sum; RSS
would count the node's shared store once per rank).

    python -m experiments.studies.scaling_host_memory --layers 96 --out results/scaling     # host_memory.csv (about 10 min)

Each point is experiments/studies/scaling_host_memory_worker.py (a Llama of `layers` narrow layers, two AdamW steps on the CPU)
alone or under torch.distributed.run; its rows carry the machine, versions and commit.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "experiments" / "studies" / "scaling_host_memory_worker.py"
POINTS = ((1, "auto"), (2, "auto"), (2, "replicated"))
# The host modes measured (engine settings); the exact split master with and without the optimizer in backward.
MODES = {"fp32": {},
         "hilo": {"compute_dtype": "bfloat16", "host_master": "hilo"},
         "hilo_in_backward": {"compute_dtype": "bfloat16", "host_master": "hilo", "optimizer_in_backward": True}}
# (ranks, data_parallel_host, modes) per row of host_memory.csv; each mode's ratios are to its one-rank row. The
# optimizer in backward has no replicated point: a private store per rank has no slab to average (refused).
STUDY = [(n, host, m) for m in ("fp32", "hilo") for n, host in POINTS] + [(1, "auto", "hilo_in_backward"),
                                                                          (2, "auto", "hilo_in_backward")]


def measure(out: Path, ranks: int, host: str, layers: int = 32, timeout_s: float = 600,
            modes: str = "fp32") -> dict:
    """Run one point into `out` (a fresh folder): summed PSS and RSS, the engine's own count of the state
    (host store + Adam, summed over ranks: one store when shared) and whether each rank shared. `modes`: a
    key of MODES (the host modes' engine settings)."""
    out.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", LAYERS=str(layers),
               HOST_MODES=json.dumps(MODES[modes]))
    cmd = [sys.executable, str(WORKER), str(out), host]
    if ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)] + cmd[1:]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{ranks} rank(s), data_parallel_host={host!r} failed:\n{proc.stdout[-3000:]}"
                           f"{proc.stderr[-3000:]}")
    reports = [json.loads((out / f"mem{r}.json").read_text()) for r in range(ranks)]
    return {"ranks": ranks, "data_parallel_host": host, "modes": modes, "layers": layers,
            "pss_bytes": sum(r["pss"] for r in reports), "rss_bytes": sum(r["rss"] for r in reports),
            "state_bytes": sum(r["state_bytes"] for r in reports), "shared": all(r["shared"] for r in reports)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=96, help="model depth (hidden 512): the state is ~50 MB/layer")
    ap.add_argument("--out", default="results/scaling", help="folder for host_memory.csv")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES), help="host modes to measure")
    ap.add_argument("--no-replicated", action="store_true",
                    help="leave out the replicated points (two whole stores: the most memory)")
    ap.add_argument("--name", default="host_memory.csv", help="file name under --out")
    args = ap.parse_args(argv)
    if args.layers < 1:
        ap.error(f"--layers {args.layers}: must be >= 1")
    from megatrain.metrics.provenance import provenance

    rows, one = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for ranks, host, modes in STUDY:
            if modes not in args.modes or (args.no_replicated and host == "replicated"):
                continue
            row = measure(Path(tmp) / f"{ranks}-{host}-{modes}", ranks, host, args.layers, modes=modes)
            one.setdefault(modes, row["pss_bytes"])
            row["pss_vs_one_rank"] = round(row["pss_bytes"] / one[modes], 4)
            rows.append(row)
            print(f"{modes:16s} {ranks} rank(s) {host:10s} PSS {row['pss_bytes'] / 2**30:6.2f} GiB "
                  f"(x{row['pss_vs_one_rank']:.3f} of 1 rank)", flush=True)
    prov = provenance("cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / args.name, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[*rows[0], *prov])
        w.writeheader()
        for row in rows:
            w.writerow({**row, **prov})
    print(f"-> {out / args.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
