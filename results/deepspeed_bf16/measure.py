"""MegaTrain's bf16 against DeepSpeed's bf16, both measured against DeepSpeed's FP32: the DeepSpeed example script
(tests/workers/ds_example/main.py: tiny Llama, stage 0, AdamW lr 1e-3, clip 1.0, 20 steps) run three ways, one
process each. Writes results/deepspeed_bf16/figures.json.

usage: PYTHONPATH=. python results/deepspeed_bf16/measure.py
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAIN = ROOT / "tests" / "workers" / "ds_example" / "main.py"


def run(out: Path, bf16: bool, megatrain: bool) -> list[float]:
    out.mkdir(parents=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    if not megatrain:
        env["MEGATRAIN_DEEPSPEED_GUARD"] = "0"
    cmd = [sys.executable, "-m", "megatrain.commands.cli", "launch", "--nproc-per-node", "1", "--master-port",
           str(port), str(MAIN), "--out", str(out), *(["--bf16"] if bf16 else [])]
    subprocess.run(cmd, check=True, env=env, cwd=out, capture_output=True)
    report = json.loads((out / "rank0.json").read_text())
    assert report["engine"] == ("MegaTrainEngine" if megatrain else "DeepSpeedEngine")
    return report["losses"]


def main() -> None:
    import deepspeed
    import torch
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        fp32 = run(Path(tmp) / "ds_fp32", False, False)
        ds_bf16 = run(Path(tmp) / "ds_bf16", True, False)
        mt_bf16 = run(Path(tmp) / "mt_bf16", True, True)

    def off(a: list[float], at: int) -> float:
        return max(abs(x - y) for x, y in zip(a[:at], fp32[:at]))

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    figures = {
        "what": "largest |loss - DeepSpeed FP32 loss| over the first 10 and 20 steps",
        "deepspeed_bf16": {"10": off(ds_bf16, 10), "20": off(ds_bf16, 20)},
        "megatrain_bf16": {"10": off(mt_bf16, 10), "20": off(mt_bf16, 20)},
        "losses": {"deepspeed_fp32": fp32, "deepspeed_bf16": ds_bf16, "megatrain_bf16": mt_bf16},
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU device", "commit": commit,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "deepspeed": deepspeed.__version__, "python": platform.python_version()},
    }
    (Path(__file__).parent / "figures.json").write_text(json.dumps(figures, indent=1) + "\n")
    print(json.dumps({k: figures[k] for k in ("deepspeed_bf16", "megatrain_bf16")}))


if __name__ == "__main__":
    main()
