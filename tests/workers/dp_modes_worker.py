"""One rank of the shared-store host-mode test (tests/integration/test_node_store.py): the exact host modes under one host
store per node, each against the same training in one process with the whole batch.

Run as `python tests/workers/dp_modes_worker.py OUT_DIR` with torchrun's variables in the environment, or call `train`
in one process for the reference. Writes OUT_DIR/modes{rank}.pt: per run, the losses, the weights before
training (every rank reads them from the node's store) and after it.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from examples_module import load_example

# Weights with an exact tie (low half 0x8000, upper half odd): hilo keeps their positions in the node's tie
# table, which the other ranks must read to get these values back (hilo.py).
TIE_BITS = (0x3F818000, 0xBC038000, 0x3C058000)
BF16 = {"compute_dtype": "bfloat16"}
HILO = {**BF16, "host_master": "hilo"}
# name -> (megatrain section, DeepSpeed face's gradient accumulation). The one-process reference of each runs
# the very micro-batches the ranks run (each rank's slice, one after another) accumulated into one step, in
# the exact hilo mode with an FP32 slab (the bf16 slabs and the optimizer in backward refuse accumulation): the
# gradients per micro-batch are then the same bits (the same bf16 kernels on the same rows), and only their
# sum's order differs. A whole-batch reference would differ by bf16 compute's batch-size noise alone.
RUNS: dict[str, tuple[dict[str, Any], int]] = {
    "hilo": (HILO, 2),
    "hilo_bf16_grads": ({**HILO, "host_grad_dtype": "bfloat16"}, 1),
    "hilo_in_backward": ({**HILO, "optimizer_in_backward": True}, 1),
}


def _tie_model(example) -> torch.nn.Module:
    model = example.build_model(seed=int(os.environ.get("RANK", "0")))
    ties = torch.tensor(TIE_BITS, dtype=torch.int64).to(torch.int32).view(torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:  # every layer: owned by each rank in turn
            layer.mlp.up_proj.weight.view(-1)[: len(ties)] = ties
    return model


def train(name: str, micro: int, world: int, rank: int, steps: int = 3, reference_of: int = 0) -> dict[str, Any]:
    """The DeepSpeed face over the example's tiny Llama with RUNS[name]'s host mode: rank `rank` of `world`
    takes its slice of each global micro-batch (world * micro rows), no clipping (the optimizer in backward
    refuses it). `reference_of`: one process (micro-batch `micro`) standing for that many ranks, see RUNS."""
    section, accumulation = RUNS[name]
    if not reference_of:
        return _train(section, accumulation, micro, world, rank, steps)
    run = lambda: _train(HILO, accumulation * reference_of, micro, world, rank, steps)  # noqa: E731
    return _bf16_rounded(run) if name == "hilo_bf16_grads" else run()


def _train(section: dict[str, Any], accumulation: int, micro: int, world: int, rank: int,
           steps: int) -> dict[str, Any]:
    import megatrain

    example = load_example("train_data_parallel")
    model = _tie_model(example)
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accumulation, "gradient_clipping": 0,
           "optimizer": {"type": "AdamW", "params": {"lr": example.LR, "weight_decay": 0.01}},
           "megatrain": {**example.engine_section(120.0), **section}}
    engine, _, _, _ = megatrain.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    before = engine.state_dict()
    data = example.Rows(steps * accumulation * micro * world)
    losses = []
    for j in range(steps * accumulation):
        start = (j * world + rank) * micro
        batch = data.ids[start: start + micro]
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if world > 1:
        t = torch.tensor(losses, dtype=torch.float64)
        torch.distributed.all_reduce(t)
        losses = (t / world).tolist()
    return {"losses": losses, "before": before, "state": engine.state_dict(),
            "shared": engine.engine.store.ranks_sharing > 1}


def _bf16_rounded(run):
    """`run()` with each layer's FP32 slab rounded to bf16 before its update reads it: what the ranks' bf16 slab
    holds (the FP32 sum of the micro-batches' gradients, rounded once); the resident parameters' FP32 slab is left
    as the ranks' is. The reference runs torch's AdamW kernel per tile, so the ranks' compiled one-loop update
    (engine/update/adam_kernel.py) is also checked against torch's bits here."""
    from megatrain.engine.update import adam_kernel, update

    update_layer = update.update_layer

    def rounded(layered, group, i, coefs, *rest):
        if group.grad is not None and group.grad.dtype == torch.float32:
            group.grad.copy_(group.grad.to(torch.bfloat16))
        return update_layer(layered, group, i, coefs, *rest)

    update.update_layer = rounded
    adam_kernel.kernel()
    compiled, adam_kernel._KERNEL.state = adam_kernel._KERNEL.state, None
    try:
        with warnings.catch_warnings():  # the kernel is off on purpose here: the engine's warning says so, not news
            warnings.filterwarnings("ignore", message="compiled AdamW kernel unavailable")
            return run()
    finally:
        update.update_layer = update_layer
        adam_kernel._KERNEL.state = compiled


def accelerator_hilo(example, accumulation: int) -> dict[str, Any]:
    """The example's Accelerator face (clipping) with the hilo master and bf16 compute, micro-batch 1."""
    section = example.engine_section
    example.engine_section = lambda watchdog_s: {**section(watchdog_s), **HILO}
    try:
        return example.run(["accelerator"], 1, 3, accumulation, 120.0)["accelerator"]
    finally:
        example.engine_section = section


def main() -> None:
    out = Path(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    from megatrain.engine.host.node_store import NodeStore

    reduce, calls = NodeStore.reduce_to_owner, [0]

    def counting(self, *a):
        calls[0] += 1
        return reduce(self, *a)

    NodeStore.reduce_to_owner = counting  # the parity below is then known to be the shared store's
    results: dict[str, Any] = {name: train(name, 1, world, rank) for name in RUNS}
    results["accelerator_hilo"] = accelerator_hilo(load_example("train_data_parallel"), 2)
    results["owner_reductions"] = calls[0]

    # The negative control: each layer's owner takes only its own gradients (no reduction across the ranks).
    def own_only(self, layer, grads, slab) -> int:
        if slab is not None:
            slab.add_(grads)
        return 0

    NodeStore.reduce_to_owner = own_only
    results["control"] = train("hilo_in_backward", 1, world, rank)
    torch.save(results, out / f"modes{rank}.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
