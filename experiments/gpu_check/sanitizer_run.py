"""The sanitizer phase's own process: `python -m experiments.gpu_check.sanitizer_run --device cuda`, started
with TORCH_CUDA_SANITIZER=1 (see sanitizer.py); prints one JSON line."""

from __future__ import annotations

import copy
import json
import sys

from .common import make_batches, tiny_model
from .parity import _train_engine, _train_reference


def main(argv: list[str] | None = None) -> int:
    import argparse

    import torch

    from megatrain.config import EngineConfig
    from megatrain.engine import Engine

    from .common import Shapes

    ap = argparse.ArgumentParser(prog="python -m experiments.gpu_check.sanitizer")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    from torch.cuda import _sanitizer

    on = _sanitizer.cuda_sanitizer is not None and _sanitizer.cuda_sanitizer.enabled
    sh = Shapes(64, 3, 256, 32, 2)  # every CUDA call is checked on the host: keep it small
    steps, accum = 2, 2
    batches = make_batches(steps * accum, sh)
    base = tiny_model("llama", sh)
    ref = copy.deepcopy(base).to(dev)
    # Both side streams busy: offloaded activations, gradients through the staging slots, and the
    # overlapped optimizer's layer updates gating the next loads.
    eng = Engine(copy.deepcopy(base), EngineConfig(device=str(dev), offload_activations=True, optimizer_overlap=True,
                                                   loss_chunk_tokens=13))
    rl, _ = _train_reference(ref, batches, steps, accum, None, dev)
    el, _, _ = _train_engine(eng, batches, steps, accum, None)
    worst = max(abs(a - b) for a, b in zip(rl, el))
    print(json.dumps({"sanitizer": on, "loss_abs": worst, "parity_ok": worst <= 1e-5, "steps": steps,
                      "device": str(dev)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
