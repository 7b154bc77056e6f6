"""One rank: weights written by hand on rank 0 only (GatheredParameters(modifier_rank=0), as DeepSpeed scripts
do) reach every rank, with the shared and the replicated host store; OUT_DIR/gathered{rank}.pt holds each
phase's final weights. Phase "control" skips the broadcast (the negative control).

Run as `python tests/workers/dp_gathered_worker.py OUT_DIR` with torchrun's variables in the environment.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from examples_module import load_example


def phase(host: str, rank: int) -> dict[str, torch.Tensor]:
    import megatrain

    example = load_example("train_data_parallel")
    model = example.build_model(seed=rank)
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "megatrain": {**example.engine_section(60.0), "data_parallel_host": host}}
    engine, _, _, _ = megatrain.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    ids = torch.arange(12).view(1, 12) + rank
    for step in range(2):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        if step == 0:
            embed = model.model.embed_tokens.weight
            q = model.model.layers[1].self_attn.q_proj.weight  # owned by rank 1 in a shared store
            with megatrain.zero.GatheredParameters([embed, q], modifier_rank=0):
                if rank == 0:
                    with torch.no_grad():
                        embed[3].fill_(0.5)
                        q.mul_(2.0)
    out = {k: v.clone() for k, v in engine.module.state_dict().items()}
    if host == "shared":
        # Saving is collective; rank 0's state is whole (Adam state for every parameter), another rank's is its
        # share, marked, and refused on load.
        sd = engine.optimizer.state_dict()
        refused = False
        if rank != 0:
            try:
                engine.optimizer.load_state_dict(sd)
            except ValueError:
                refused = True
        out["_optimizer"] = {"states": len(sd["state"]), "params": len(list(model.parameters())), "refused": refused}
    return out


def main() -> None:
    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    from megatrain.engine.parallel.distributed import DataParallel

    results = {"shared": phase("shared", rank), "replicated": phase("replicated", rank)}
    results["optimizer"] = results["shared"].pop("_optimizer")
    DataParallel.broadcast_from = lambda self, store, src: None
    results["control"] = phase("shared", rank)
    results["control"].pop("_optimizer")
    torch.save(results, out / f"gathered{rank}.pt")


if __name__ == "__main__":
    main()
