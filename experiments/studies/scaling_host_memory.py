"""Host memory of data parallel on one machine: what 1 rank, 2 ranks sharing one host store and 2 ranks with
private stores hold together, measured as the SUM of the ranks' PSS (shared pages count once in that sum; RSS
would count the node's shared store once per rank).

    python -m experiments.studies.scaling_host_memory --layers 96 --out results/scaling     # host_memory.csv (about 3 min)

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


def measure(out: Path, ranks: int, host: str, layers: int = 32, timeout_s: float = 600) -> dict:
    """Run one point into `out` (a fresh folder): summed PSS and RSS, the engine's own count of the state
    (host store + Adam, summed over ranks: one store when shared) and whether each rank shared."""
    out.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", LAYERS=str(layers))
    cmd = [sys.executable, str(WORKER), str(out), host]
    if ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)] + cmd[1:]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{ranks} rank(s), data_parallel_host={host!r} failed:\n{proc.stdout[-3000:]}"
                           f"{proc.stderr[-3000:]}")
    reports = [json.loads((out / f"mem{r}.json").read_text()) for r in range(ranks)]
    return {"ranks": ranks, "data_parallel_host": host, "layers": layers,
            "pss_bytes": sum(r["pss"] for r in reports), "rss_bytes": sum(r["rss"] for r in reports),
            "state_bytes": sum(r["state_bytes"] for r in reports), "shared": all(r["shared"] for r in reports)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=96, help="model depth (hidden 512): the state is ~50 MB/layer")
    ap.add_argument("--out", default="results/scaling", help="folder for host_memory.csv")
    args = ap.parse_args(argv)
    if args.layers < 1:
        ap.error(f"--layers {args.layers}: must be >= 1")
    from megatrain.metrics.provenance import provenance

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for ranks, host in POINTS:
            row = measure(Path(tmp) / f"{ranks}-{host}", ranks, host, args.layers)
            rows.append(row)
            print(f"{ranks} rank(s) {host:10s} PSS {row['pss_bytes'] / 2**30:6.2f} GiB "
                  f"(x{row['pss_bytes'] / rows[0]['pss_bytes']:.3f} of 1 rank)", flush=True)
    prov = provenance("cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "host_memory.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[*rows[0], "pss_vs_one_rank", *prov])
        w.writeheader()
        for row in rows:
            w.writerow({**row, "pss_vs_one_rank": round(row["pss_bytes"] / rows[0]["pss_bytes"], 4), **prov})
    print(f"-> {out / 'host_memory.csv'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
