"""One rank of a data-parallel test run: examples/train_data_parallel.py with faults or a broken reduction.

Run as `python tests/workers/dp_worker.py OUT_DIR JSON_ARGS` with torchrun's variables in the environment.
JSON_ARGS: faces, micro, steps, accumulation, watchdog_s, and
  every_sync: also train the accelerator face with every micro-batch's backward averaging (not only the
      last before a step): slabs holding an averaged part plus local parts are averaged again,
  control: "skip_average" — every rank keeps its own gradients (the negative control of the parity test;
      with the shared host store each layer's owner takes only its own),
  fault: "die" | "hang" — rank 1 exits / sleeps before its third forward, after writing OUT_DIR/fault_time.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from examples_module import load_example


def inject_fault(fault: str, out: Path) -> None:
    from megatrain.engine.engine import Engine

    forward = Engine.forward
    calls = [0]

    def faulty(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:  # one whole optimizer step (two micro-batches) went through first
            (out / "fault_time").write_text(repr(time.time()))
            if fault == "die":
                os._exit(17)
            time.sleep(3600)
        return forward(self, *args, **kwargs)

    Engine.forward = faulty


def main() -> None:
    out, args = Path(sys.argv[1]), json.loads(sys.argv[2])
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    example = load_example("train_data_parallel")
    fault = args.pop("fault", "none")
    if fault != "none" and rank == 1:
        inject_fault(fault, out)
    from megatrain.engine.host.node_store import NodeStore
    from megatrain.engine.parallel.distributed import DataParallel

    # Count the shared host store's reductions and (optimizer_overlap) layer-update tokens: the parity below is
    # then known to be these paths'.
    originals = {name: getattr(NodeStore, name) for name in ("reduce_to_owner", "publish")}
    counts = dict.fromkeys(originals, 0)

    def counting(name: str):
        def call(self, *a):
            counts[name] += 1
            return originals[name](self, *a)
        return call

    for name in originals:
        setattr(NodeStore, name, counting(name))
    results = example.run(args["faces"], args["micro"], args["steps"], args["accumulation"], args["watchdog_s"])
    results["owner_reductions"], results["update_tokens"] = counts["reduce_to_owner"], counts["publish"]
    for name, fn in originals.items():
        setattr(NodeStore, name, fn)
    if args.get("every_sync"):
        from megatrain.backend import MegatrainBackend

        backward = MegatrainBackend.backward
        MegatrainBackend.backward = lambda self, loss, *, sync: backward(self, loss, sync=True)
        results["every_sync"] = example.run(["accelerator"], args["micro"], args["steps"], args["accumulation"],
                                            args["watchdog_s"])["accelerator"]
        MegatrainBackend.backward = backward
    if args.get("slow_updates"):
        # The layer updates (a layer's owner, on its optimizer thread) take longer than the other ranks' next
        # forward needs to reach the layer: with the tokens the result is unchanged; without them (the negative
        # control) the others load the layer before its owner has written it.
        # A layer's update is the fused tile pass (engine/update/fused.py), which does not call AdamW.step: slow the
        # per-layer update itself.
        from megatrain.engine.update import update as update_mod

        layer_update = update_mod.update_layer

        def slow_update(layered, group, *a, **k):
            # Only the owner's: the others' update job of a layer they do not own is a no-op, and slowing it too
            # held their next load back about as long as the owner's update (the negative control then raced
            # only by the time the update itself took, which the compiled pass made a few milliseconds).
            if group.owned:
                time.sleep(0.3)
            return layer_update(layered, group, *a, **k)


        update_mod.update_layer = slow_update
        results["slow_updates"] = example.run(["deepspeed"], args["micro"], args["steps"], args["accumulation"],
                                              args["watchdog_s"])["deepspeed"]
        NodeStore.publish = lambda self, layer: None
        results["slow_no_tokens"] = example.run(["deepspeed"], args["micro"], args["steps"], args["accumulation"],
                                                args["watchdog_s"])["deepspeed"]
        update_mod.update_layer = layer_update
    if args.get("control") == "skip_average":
        DataParallel.average_ = lambda self, grad: None
        # The shared host store's reduction: the owner adds its own gradients only.
        def own_only(self, layer, grads, slab) -> int:
            if slab is not None:
                slab.add_(grads)
            return 0

        NodeStore.reduce_to_owner = own_only
        results["control"] = example.run(["deepspeed"], args["micro"], args["steps"], args["accumulation"],
                                         args["watchdog_s"])["deepspeed"]
    torch.save(results, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
