"""One rank of the non-finite agreement test (tests/integration/test_dp_nonfinite.py): two ranks share one host store with
the optimizer in backward; rank 0's gradients of layer 1 (owned by rank 1) turn non-finite at the second step,
so only rank 1, the owner, sees a non-finite average. Every rank must then fail that step the same way.

Run as `python tests/workers/dp_nonfinite_worker.py OUT_DIR` with torchrun's variables in the environment. Writes
OUT_DIR/nonfinite{rank}.pt: per run ("agreed", then "control" with the agreement turned off), each step's
outcome, the resident parameters' masters and Adam step counts after the failed step, and the next backward's;
"default_step" runs the ordinary step (no optimizer in backward), which skips the step on every rank.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # conftest's model and batch helpers
from conftest import make_batches, tiny_model

BAD_LAYER = 1  # owned by rank 1 of 2 (layer i: node rank i mod 2)
POISON = [False]  # set for the second step of each run


def _outcome(call) -> str:
    try:
        done = call()
        return "done" if done is None else "stepped" if done else "skipped"
    except Exception as exc:  # the outcome is what the test compares across ranks
        return f"{type(exc).__name__}: {exc}"


def run(rank: int, in_backward: bool = True) -> dict[str, Any]:
    """Two steps, the second poisoned. `in_backward`: the optimizer in backward, else the default step."""
    from megatrain.config.schema import EngineConfig
    from megatrain.engine.engine import Engine

    eng = Engine(tiny_model(seed=0), EngineConfig(device="cpu", optimizer_in_backward=in_backward,
                                                  parity_probe=False, watchdog_s=30.0),
                 optimizer=lambda named: torch.optim.AdamW([p for _, p in named], lr=1e-3))
    assert eng.node is not None and eng.store.ranks_sharing == 2, "the test needs the node's shared store"
    outcomes = []
    for j, batch in enumerate(make_batches(2, seed=1 + rank)):  # each rank its own rows
        eng.zero_grad()
        POISON[0] = j == 1
        outcomes.append(_outcome(lambda b=batch: (eng.backward(eng(**b).loss), eng.step())[1]))
        POISON[0] = False
    print(f"rank {rank} outcomes: {outcomes}", flush=True)  # what happened, in the log
    synced = _outcome(lambda: eng.synchronize() or True)  # the control's rank 0 may find the group broken
    resident = eng.store.globals.params
    return {"outcomes": outcomes,
            "resident": [p.detach().clone() for p in resident],
            "adam_steps": [float(eng.optimizer.state[p]["step"]) if p in eng.optimizer.state else 0.0
                           for p in resident],
            "synchronize": synced,
            "next": _outcome(lambda: eng.backward(eng(**make_batches(1, seed=9)[0]).loss))}


def main() -> None:
    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    from megatrain.engine.host.node_store import NodeStore
    from megatrain.engine.parallel import ranks

    reduce = NodeStore.reduce_to_owner

    def poisoned(self, layer, grads, slab):
        if layer == BAD_LAYER and rank == 0 and POISON[0]:  # rank 0's rows give an inf in a layer rank 1 owns
            grads = grads.clone()
            grads.view(-1)[0] = float("inf")
        return reduce(self, layer, grads, slab)

    NodeStore.reduce_to_owner = poisoned
    results = {"agreed": run(rank), "default_step": run(rank, in_backward=False)}
    # The negative control: each rank keeps its own verdict (no agreement across the ranks).
    ranks.SharedStore.agree_max = lambda self, value, what: value
    results["control"] = run(rank)
    torch.save(results, out / f"nonfinite{rank}.pt")
    sys.stdout.flush()
    os._exit(0)  # a control rank may have left the group broken: no collective on the way out


if __name__ == "__main__":
    main()
