"""One rank (or the lone reference process) of tests/integration/test_node_path.py: a tiny Llama trained on the
CPU device with every layer streamed, accumulation 2 and clipping that acts, on the node path or the per-rank path
(EngineConfig.data_parallel_path, set by the test). Rank r of W takes rows [(j*W + r)*b, (j*W + r + 1)*b) of global
micro-batch j, which a lone process with micro-batch W*b takes whole.

Run as `python tests/workers/node_path_worker.py OUT_DIR JSON_ARGS` (under torchrun, or alone); JSON_ARGS: micro,
world (the global batch is world x micro), steps, layers, runs (each "PATH" or "PATH:CONTROL": the data path asked
for and a negative control, `controls`), one engine after another. Writes OUT_DIR/rank{r}.pt: per run, each
micro-batch's loss (averaged over the ranks: the global batch's), each step's pre-clip norm, the final weights, the
per-step stats and the data path the engine ran.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

from megatrain.config.schema import EngineConfig
from megatrain.engine import Engine

VOCAB, SEQ, LR, CLIP = 128, 12, 1e-3, 0.05
NO_CLIP = 1e9  # "noclip": a clip whose coefficient is 1 (scales nothing), for the bit-for-bit comparison of updates
# Runs' settings besides the defaults above: the GPU's defaults, one at a time (bf16 compute; the layer updates
# overlapped with the next forward, whose loads then wait for each layer's owner's token).
SETTINGS = {"bf16": {"compute_dtype": "bfloat16"}, "overlap": {"optimizer_overlap": True},
            # bf16 gradient slabs (exact with one micro-batch per step: "bf16slab" runs so, and without a clip that
            # scales, for the bit-for-bit comparison)
            "bf16slab": {"compute_dtype": "bfloat16", "host_master": "fp32", "host_grad_dtype": "bfloat16"}}


def build_model(layers: int) -> torch.nn.Module:
    torch.manual_seed(int(os.environ.get("RANK", "0")))  # differing inits: the engine starts from rank 0's
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=88, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                   max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(cfg)


def controls(name: str):
    """Break one half of the node path (the negative controls): "skip_gather": a rank's ring slot holds only its own
    shard (the rest whatever the slot held before); "skip_scatter": a rank's shard is its own gradient, not the
    node's sum; "whole_update": every rank's host update writes every layer whole (its slab zero outside its
    ranges). And, no controls: "chunkN", the layers cut into chunks of N elements; "noclip"; "adamw" (the
    optimizer given built, not as a factory; "cpu": so, with "auto" choosing by the CPU device's own rule, where
    every other run's "auto" chooses as on a GPU node); SETTINGS' names. Returns what undoes it."""
    from megatrain.engine.parallel import node_path

    saved = {k: getattr(node_path, k) for k in ("gather_layer", "reduce_scatter_into", "CHUNK", "AUTO_ON_CPU")}
    # "auto" choosing as on a GPU node (the gloo ranks standing in for its GPUs), but for "cpu": the CPU's own rule
    node_path.AUTO_ON_CPU = name != "cpu"
    if name.startswith("chunk"):  # not a control: the shard map cut into chunks of this many elements
        node_path.CHUNK = int(name[len("chunk"):])
    elif name == "whole_update":  # every rank updates every element of every layer, not its ranges
        from megatrain.engine.update import by_shard

        update = by_shard.update
        by_shard.update = lambda view, group, coefs, ranges: update(view, group, coefs, [(0, group.numel)])
        return lambda: [setattr(by_shard, "update", update), *(setattr(node_path, k, v) for k, v in saved.items())]
    elif name == "skip_gather":
        node_path.gather_layer = lambda buf, smap, group, stats=None: None
    elif name == "skip_scatter":
        def own_only(out, flat, group, stats=None):
            out.copy_(flat.chunk(dist.get_world_size(group))[dist.get_rank(group)])
        node_path.reduce_scatter_into = own_only
    return lambda: [setattr(node_path, k, v) for k, v in saved.items()]


def main() -> None:
    out, args = Path(sys.argv[1]), json.loads(sys.argv[2])
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    results = {run: run_one(run, args) for run in args.get("runs", ["node"])}
    torch.save(results, out / f"rank{rank}.pt")


def run_one(run: str, args: dict) -> dict:
    """The run `run` ("PATH" or "PATH:CONTROL"), one engine's."""
    path, _, control = run.partition(":")
    undo = controls(control)
    try:
        clip = NO_CLIP if control in ("noclip", "bf16slab") else CLIP
        return train(args, {"data_parallel_path": path, **SETTINGS.get(control, {})}, clip,
                     given=control in ("adamw", "cpu"), accum=1 if control == "bf16slab" else 2)
    finally:
        undo()


def train(args: dict, settings: dict, clip: float = CLIP, given: bool = False, accum: int = 2) -> dict:
    """One engine's run; `given`: the optimizer handed over built ("adamw": torch's AdamW over the model's
    parameters, which the engine makes fused), else a factory."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    micro, steps = args["micro"], args["steps"]
    cfg = EngineConfig(**{"device": "cpu", "parity_probe": False, "residency": "stream", "watchdog_s": 120.0,
                          "compute_dtype": "float32", "speculative_step": False, **settings})
    model = build_model(args["layers"])
    engine = Engine(model, cfg, optimizer=torch.optim.AdamW(model.parameters(), lr=LR) if given else
                    lambda named: torch.optim.AdamW([p for _, p in named], lr=LR))
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, VOCAB, (args["world"] * micro * steps * accum, SEQ), generator=g)
    losses, norms, stats = [], [], []
    per_global = args["world"] * micro
    for s in range(steps):
        engine.reset_stats()
        for j in range(accum):
            at = (s * accum + j) * per_global + rank * micro
            ids = rows[at: at + micro]
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss / accum)
            got = loss.detach().clone()
            if world > 1:
                dist.all_reduce(got)  # the global batch's mean loss: every rank's rows have equal label tokens
                got /= world
            losses.append(float(got))
        norms.append(float(engine.clip_grad_norm_(clip)))
        engine.step()
        engine.zero_grad()
        engine.synchronize()  # every update of the step done: its count is whole
        layered = engine.update.layered
        stats.append({**engine.collect_stats(),
                      "updated_elements": layered.updated_elements if layered is not None else None})
    state = {k: v.detach().clone() for k, v in engine.state_dict().items()}
    path = getattr(engine, "data_path", None)
    return {"losses": losses, "norms": norms, "stats": stats, "state": state,
            "data_path": path.describe() if path is not None else None}


if __name__ == "__main__":
    main()
