"""One rank (or the lone reference process) of tests/integration/test_shared_store.py: a tiny Llama of 8 layers trained
on the CPU device in FP32, every layer streamed, accumulation 2 and clipping that acts. Rank r of W takes rows
[(j*W + r)*b, (j*W + r + 1)*b) of global micro-batch j, which a lone process with micro-batch W*b takes whole. Every
rank builds the same weights (one seed): with nodes sharing one store each layer starts from its owner's.

Run as `python tests/workers/shared_store_worker.py OUT_DIR JSON_ARGS` (under torchrun, or alone); JSON_ARGS: micro,
world, steps, layers, budget (host_budget_bytes, or null; budgets: a run's own), runs (one engine after another: "plain", "overlap" or a
negative control, `control`; "bf16...": bf16 compute; "hilo...", "bf16m...": bf16 compute with host_master "hilo" / "bf16"; "resume": the first half of the steps, a checkpoint saved by every rank, the rest
in a fresh engine that loads it; "alone": "plain" whose engine's joins wait ALONE_JOIN_S, then the calls by one rank
alone (`alone`); "refused...": a run under its budget that the engine refuses; a lone process's `fractions`: a run's
budget as that fraction of its own "plain" run's whole store). Writes OUT_DIR/rank{r}.pt, per run: each micro-batch's
loss (averaged over the ranks: the global batch's), each step's pre-clip norm, the weights of the
layers this rank owns and the resident parameters, each step's stats and the data path; or, where the engine refused,
the refusal's message; and engine.state_dict() at the end (every rank's: the other nodes' layers gathered).
The runs named in `extras` add an evaluation forward's logits, the model object's state_dict() and its
save_pretrained() output (`extras`); the "alone" run has one rank evaluate, and one rank call model.state_dict(), by
itself (`alone`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

from megatrain.config.schema import EngineConfig
from megatrain.engine import Engine
from megatrain.engine.host.preflight import HostMemoryError

VOCAB, SEQ, LR, CLIP, ACCUM = 128, 12, 1e-3, 0.05, 2
# The "alone" run's join timeout (shared_store.JOIN_S, 10 s): a rank alone is refused only once it runs out, so the
# test waits it out twice; its own run keeps the 10 s for the other runs' joins, which every rank reaches together.
ALONE_JOIN_S = 2.0


def build_model(layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=88, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                   max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(cfg)


def control(name: str):
    """Break one half of the shared store (the negative controls): "skip_broadcast": a non-owned layer's ring slot
    keeps whatever it held (no weights from the owner); "skip_reduce": the owner's slab takes its own gradient
    alone, halved as if summed. "overlap": not a control, the layer updates overlapped with the next forward.
    Returns what undoes it."""
    from megatrain.engine.parallel import ranks, shared_store

    gather, reduce = shared_store.SharedWeights.gather, ranks.dist.reduce
    if name == "skip_broadcast":
        def own_only(self, buffer, numel):
            self.pending.popleft()
            return 0
        shared_store.SharedWeights.gather = own_only
    elif name == "skip_reduce":
        ranks.dist.reduce = lambda *a, **k: None
    return lambda: (setattr(shared_store.SharedWeights, "gather", gather), setattr(ranks.dist, "reduce", reduce))


def main() -> None:
    out, args = Path(sys.argv[1]), json.loads(sys.argv[2])
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    results = {}
    for run in args.get("runs", ["plain"]):
        undo = control(run)
        try:
            if run == "resume":  # the first half, saved (every rank calls state_dict); a fresh engine loads it
                ckpt = out / "checkpoint.pt"
                half = args["steps"] // 2
                first = train({**args, "stop": half, "save": str(ckpt)})
                rest = train({**args, "start": half, "load": str(ckpt)})
                results[run] = {**rest, "losses": first["losses"] + rest["losses"], "norms": first["norms"] + rest["norms"]}
            else:
                budget = args.get("budgets", {}).get(run, args.get("budget"))
                if run in args.get("fractions", {}):  # a lone process: of its own "plain" run's whole store
                    budget = int(args["fractions"][run] * results["plain"]["stats"][0]["host_store_bytes"])
                master = "hilo" if run.startswith("hilo") else "bf16" if run.startswith("bf16m") else "auto"
                results[run] = train({**args, "overlap": run == "overlap", "budget": budget, "master": master,
                                      "bf16": run.startswith(("bf16", "hilo")), "run": run, "out": str(out),
                                      "do_extras": run in args.get("extras", ()), "lone": run == "alone"})
        except HostMemoryError as exc:
            results[run] = {"refused": str(exc)}
        finally:
            undo()
    torch.save(results, out / f"rank{rank}.pt")


def train(args: dict) -> dict:
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    micro, steps = args["micro"], args["steps"]
    dtype = "bfloat16" if args.get("bf16") else "float32"
    cfg = EngineConfig(device="cpu", parity_probe=False, residency="stream", watchdog_s=120.0, compute_dtype=dtype,
                       speculative_step=False, host_budget_bytes=args.get("budget"),
                       host_master=args.get("master", "auto"),
                       optimizer_overlap=args.get("overlap", False))
    from megatrain.engine.parallel import shared_store

    join_s = shared_store.JOIN_S
    shared_store.JOIN_S = ALONE_JOIN_S if args.get("lone") else join_s
    try:
        engine = Engine(build_model(args["layers"]), cfg,
                        optimizer=lambda named: torch.optim.AdamW([p for _, p in named], lr=LR))
    finally:
        shared_store.JOIN_S = join_s
    if args.get("load"):
        saved = torch.load(args["load"])
        engine.load_state_dict(saved["model"])
        engine.optimizer.load_state_dict(saved["optimizer"])
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, VOCAB, (args["world"] * micro * steps * ACCUM, SEQ), generator=g)
    losses, norms, stats = [], [], []
    per_global = args["world"] * micro
    for s in range(args.get("start", 0), args.get("stop", steps)):
        engine.reset_stats()
        for j in range(ACCUM):
            at = (s * ACCUM + j) * per_global + rank * micro
            ids = rows[at: at + micro]
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss / ACCUM)
            got = loss.detach().clone()
            if world > 1:
                dist.all_reduce(got)  # the global batch's mean loss: every rank's rows have equal label tokens
                got /= world
            losses.append(float(got))
        norms.append(float(engine.clip_grad_norm_(CLIP)))
        engine.step()
        engine.zero_grad()
        stats.append(engine.collect_stats())
    if args.get("save"):
        whole = {"model": engine.state_dict(), "optimizer": engine.optimizer.state_dict()}  # collective, both
        if rank == 0:
            torch.save(whole, args["save"])
        if world > 1:
            dist.barrier()  # the file is whole before any rank reads it
    engine.synchronize()
    prefix = engine.parts.layers_prefix
    owned = {i for i, grp in enumerate(engine.store.layers) if grp.owned}
    state = {n: p.detach().clone() for n, p in engine.named_parameters()
             if not n.startswith(prefix + ".") or int(n[len(prefix) + 1:].split(".")[0]) in owned}
    got = {"losses": losses, "norms": norms, "stats": stats, "state": state, "owned": sorted(owned),
           "data_path": engine.data_path.describe()}
    if not args.get("lone"):  # (the "alone" run's only joins are the calls by one rank, under ALONE_JOIN_S)
        got["whole"] = engine.state_dict()
    if args.get("do_extras"):
        got.update(extras(engine, rows[rank * micro: (rank + 1) * micro], args))
    if args.get("lone") and world > 1:
        got.update(alone(engine, rows[rank * micro: (rank + 1) * micro]))
    return got


def extras(engine: Engine, ids: torch.Tensor, args: dict) -> dict:
    """After training, on every rank: an evaluation forward's logits, the model object's state_dict() and what its
    save_pretrained() wrote (OUT_DIR/<run>-saved<rank>)."""
    from safetensors.torch import load_file

    rank = int(os.environ.get("RANK", "0"))
    model = engine.module
    model.eval()
    with torch.no_grad():
        logits = engine(input_ids=ids, return_logits=True).logits.detach().clone()
    model_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    saved = Path(args["out"]) / f"{args['run']}-saved{rank}"
    model.save_pretrained(saved)
    got = {"eval_logits": logits, "model_state": model_state,
           "saved": {k: v.clone() for f in sorted(saved.glob("*.safetensors")) for k, v in load_file(f).items()}}
    model.train()
    return got


def alone(engine: Engine, ids: torch.Tensor) -> dict:
    """After training: rank 0 runs an evaluation forward by itself while rank 1 waits in a barrier, then rank 1
    calls model.state_dict() by itself while rank 0 waits: each records what it raised (type, message) and how long
    it took, or what it returned; then both evaluate together ("after_forward")."""
    rank = int(os.environ.get("RANK", "0"))
    model, got = engine.module, {}
    model.eval()
    for who, call, key in ((0, lambda: engine(input_ids=ids, return_logits=True), "alone_forward"),
                           (1, model.state_dict, "alone_state_dict")):
        if rank == who:
            t0 = time.monotonic()
            try:
                value = call()
                got[key] = {"returned": value if isinstance(value, dict) else None}
            except Exception as exc:
                got[key] = {"type": type(exc).__name__, "message": str(exc)}
            got[key]["seconds"] = time.monotonic() - t0
        dist.barrier()
    # then every rank evaluates together: the forwards' join was shut by rank 0's refusal, on both ranks
    t0 = time.monotonic()
    try:
        engine(input_ids=ids, return_logits=True)
        got["after_forward"] = {"returned": True}
    except Exception as exc:
        got["after_forward"] = {"type": type(exc).__name__, "message": str(exc)}
    got["after_forward"]["seconds"] = time.monotonic() - t0
    dist.barrier()
    model.train()
    return got


if __name__ == "__main__":
    main()
