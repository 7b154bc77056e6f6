"""One rank (or the lone reference process) of tests/integration/test_node_residency.py: node_path_worker.py's tiny
Llama and training loop (accumulation 2, clipping that acts), on the node path with some layers kept sharded
(docs/DISTRIBUTED.md section 4) or every layer streamed.

Run as `python tests/workers/node_residency_worker.py OUT_DIR JSON_ARGS` (under torchrun, or alone); JSON_ARGS as
node_path_worker.py's, `runs` each "PATH[:OPTION...]": "kN" keeps the first N layers (residency weights N), "gM"
keeps the first M of them with their graph (activations M: those stay whole), "bf16" computes in bf16, "stale" is
the negative control (each kept shard refreshed from the host once, never again: stale weights after the first
step), "eval" a no-grad forward before every backward; a run with another option is node_path_worker.py's own
("PATH:CONTROL", node_path_worker.run_one), so one launch serves tests/integration/test_node_path.py too. Writes
OUT_DIR/rank{r}.pt: per run, node_path_worker.train's results.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import node_path_worker as base  # noqa: E402 - the model, the data and the loop the node path's own test uses

from megatrain.engine.parallel import node_path  # noqa: E402


def stale() -> callable:
    """The control: NodeWeights.refresh copies a shard's ranges the first time only (each shard tensor once), so
    after the first update a kept layer computes with the weights it started from. Returns what undoes it."""
    refresh = node_path.NodeWeights.refresh
    seen: set[int] = set()

    def once(self, shard, src, numel):
        if shard.data_ptr() in seen:
            return 0
        seen.add(shard.data_ptr())
        return refresh(self, shard, src, numel)

    node_path.NodeWeights.refresh = once
    return lambda: setattr(node_path.NodeWeights, "refresh", refresh)


def eval_between() -> callable:
    """Every backward preceded by a no-grad forward of other rows (a non-training forward between a training
    forward and its backward, which plans the kept weights without graphs). Returns what undoes it."""
    from megatrain.engine import Engine

    backward = Engine.backward
    rows = torch.randint(0, base.VOCAB, (1, base.SEQ), generator=torch.Generator().manual_seed(7))

    def with_eval(self, *args, **kwargs):
        with torch.no_grad():
            self(input_ids=rows)
        return backward(self, *args, **kwargs)

    Engine.backward = with_eval
    return lambda: setattr(Engine, "backward", backward)


def residency_run(options: list[str]) -> bool:
    """Whether a run has options and every one is this worker's (else the run is node_path_worker's: "auto" there
    chooses as on a GPU node)."""
    return bool(options) and all(o in ("bf16", "stale", "eval") or (o[:1] in "kg" and o[1:].isdigit()) for o in options)


def settings_of(options: list[str]) -> tuple[dict, callable]:
    settings: dict = {}
    weights = graphs = 0
    undo = lambda: None  # noqa: E731
    for opt in options:
        if opt.startswith("k"):
            weights = int(opt[1:])
        elif opt.startswith("g"):
            graphs = int(opt[1:])
        elif opt == "bf16":
            settings["compute_dtype"] = "bfloat16"
        elif opt == "stale":
            undo = stale()
        elif opt == "eval":
            undo = eval_between()
        else:
            raise ValueError(f"unknown option {opt!r}")
    settings["residency"] = {"weights": weights, "activations": graphs} if weights else "stream"
    return settings, undo


def main() -> None:
    out, args = Path(sys.argv[1]), json.loads(sys.argv[2])
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    results = {}
    for run in args["runs"]:
        path, *options = run.split(":")
        if not residency_run(options):
            results[run] = base.run_one(run, args)
            continue
        settings, undo = settings_of(options)
        try:
            results[run] = base.train(args, {"data_parallel_path": path, **settings}, base.CLIP)
        finally:
            undo()
    torch.save(results, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
