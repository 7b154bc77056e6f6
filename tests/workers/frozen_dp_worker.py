"""One rank of tests/integration/test_frozen_faces.py's torchrun run: each case of tests/frozen_cases.py (a part of
the model frozen; a PEFT LoRA model where peft is installed) trained through megatrain.initialize, 5 steps, each rank on its own batches. Rank 0 writes
OUT/results.json: per case, each rank's losses, the engine's pre-clip norms, and whether a frozen tensor moved."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from frozen_cases import BATCHES_DP, STEPS, build, dp_cases, ds_config  # noqa: E402

import megatrain  # noqa: E402


def main() -> None:
    out, rank = Path(sys.argv[1]), int(os.environ["RANK"])
    torch.set_num_threads(1)
    results = {}
    for case in dp_cases():
        model = build(case)
        frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = ds_config(train_batch_size=4)
            # as the other data-parallel workers: the probe's own small engine joins the job, and a shared host
            # store's rank holds the gradients of its own layers only (the probe reads them all)
            cfg["megatrain"]["parity_probe"] = False
            engine, *_ = megatrain.initialize(model=model, config=cfg)
        losses, norms = [], []
        for s in range(STEPS):
            loss = engine(**BATCHES_DP[2 * s + rank]).loss
            engine.backward(loss)
            engine.step()
            norms.append(float(engine.get_global_grad_norm()))
            losses.append(loss.item())
        state = model.state_dict()
        moved = [n for n, v in frozen.items() if not torch.equal(state[n].cpu(), v)]
        flags = sorted(n for n, p in model.named_parameters() if not p.requires_grad)
        gathered = [None, None]
        dist.all_gather_object(gathered, {"losses": losses, "norms": norms, "moved": moved, "flags": flags})
        results[case] = gathered
    if rank == 0:
        (out / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
