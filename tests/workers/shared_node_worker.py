"""One rank (or the lone reference process) of tests/integration/test_shared_node.py: nodes sharing one store with
several ranks per node. A tiny Llama trained on the CPU device, every layer streamed, accumulation 2 and clipping
that acts. Rank r of W takes rows [(j*W + r)*b, (j*W + r + 1)*b) of global micro-batch j, which a lone process with
micro-batch W*b takes whole. Every rank builds the same weights (one seed).

Run as `python tests/workers/shared_node_worker.py OUT_DIR JSON_ARGS` (under torchrun, or alone); JSON_ARGS: micro,
world, steps, layers, intermediate, budgets (host_budget_bytes per run, or null), runs (one engine after another:
"plain" FP32; "frozen": FP32 with the FROZEN parameters not trained; "bf16": bf16 compute; "hilo", "bf16m": bf16 compute with host_master "hilo" / "bf16"; "..._whole": each node its whole store, on the per-rank path; "overlap": the layer updates overlapped with the next forward; the negative
controls "skip_broadcast" (another node's layer keeps whatever its ring slot held) and "skip_reduce" (the owner
node's shard holds its own node's sum alone); "resume": the first half of the steps, a checkpoint (engine.state_dict() and the optimizer's,
both collective) saved, the rest in a fresh engine that loads it; "cuda_auto": the plan settle_engine makes of the
defaults for a CUDA device (pin_memory, optimizer_overlap, speculative_step "if it fits") on this CPU device, a recorder
standing in for cudaHostRegister (PINNED); "deepspeed": the DeepSpeed face, save_checkpoint after the first step, then
"deepspeed_resumed": a fresh engine's load_checkpoint of it and the rest; "refuse_...": a setting not built for it,
REFUSALS; the speculative step's "spec_serial" (speculative_step=False), "spec" (True) and its negative control
"spec_norollback" (rank 1's rollback copies never written back): SPEC_CLIPS.length steps, each step's clip from
SPEC_CLIPS, and rank 0's second micro-batch of SPEC_NAN_STEP made non-finite (skip_nonfinite skips the step), the
speculative jobs waited for after each backward so which layers a verdict rolls back is the verdicts', not the host's
timing; these add this rank's Adam state). Writes OUT_DIR/rank{r}.pt, per run: each micro-batch's loss (the
global batch's), each step's pre-clip norm, engine.state_dict() at the end (every layer, the other nodes' gathered
from their owners), each step's stats, the data path, the layers this rank's node owns, and this node's host bytes
as this rank sees them (the node's shared memory, counted on every rank of it, and this rank's own: slabs, resident
parameters, optimizer state); or, where the engine refused, the refusal's message. The runs named in `extras` add an
evaluation forward's logits of the first row and the model object's state_dict(), on every rank.
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
from megatrain.config.settle import EngineFacts, settle_engine
from megatrain.engine import Engine
from megatrain.engine.host.preflight import HostMemoryError

VOCAB, SEQ, LR, CLIP, ACCUM = 64, 8, 1e-3, 0.05, 2


def build_model(layers: int, intermediate: int) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=intermediate, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                   max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(cfg)


# The "frozen" run's parameters set requires_grad=False (by name prefix): a whole layer and one weight of another
FROZEN = ("model.layers.1.", "model.layers.7.mlp.down_proj.")

# What nodes sharing one store with several ranks per node refuse, by run name: the setting that asks for it
REFUSALS = {"refuse_per_rank": {"data_parallel_path": "per_rank"}, "refuse_kept": {"residency": {"weights": 2}},
            "refuse_in_backward": {"optimizer_in_backward": True}}


# The speculative runs' steps: a clip that scales nothing (1e9) or scales (0.05 against norms above 0.1), and the
# step whose gradients rank 0 makes non-finite (its clip alone would scale nothing: the skip rolls it back)
SPEC_CLIPS, SPEC_NAN_STEP = [1e9, 1e9, 0.05, 1e9], 3
SPEC_RUNS = ("spec_serial", "spec", "spec_norollback")


# What the host store pinned in the run "cuda_auto" (pinned.cuda_register stood in for by a recorder on the CPU):
# (address, bytes) of every registration, in order
PINNED: list[tuple[int, int]] = []


def control(name: str):
    """Break one half of the sharing (the negative controls), or record what is pinned ("cuda_auto"). Returns what
    undoes it."""
    from megatrain.engine.host import pinned
    from megatrain.engine.parallel import node_path

    if name == "cuda_auto":
        register, unregister = pinned.cuda_register, pinned.cuda_unregister
        PINNED.clear()
        pinned.cuda_register = lambda ptr, nbytes: PINNED.append((ptr, nbytes))
        pinned.cuda_unregister = lambda ptr: None
        return lambda: (setattr(pinned, "cuda_register", register), setattr(pinned, "cuda_unregister", unregister))
    if name == "spec_norollback" and int(os.environ.get("RANK", "0")) == 1:
        from megatrain.engine.update.speculative import StateCopy

        restore = StateCopy.restore
        StateCopy.restore = lambda self, group, view: None
        return lambda: setattr(StateCopy, "restore", restore)
    if name not in ("skip_broadcast", "skip_reduce"):
        return lambda: None
    gather, reduce = node_path.SpanningWeights.gather, node_path.dist.reduce
    if name == "skip_broadcast":
        def no_broadcast(self, buffer, numel):
            self.pending.popleft()
            return node_path.NodeWeights.gather(self, buffer, numel)
        node_path.SpanningWeights.gather = no_broadcast
    elif name == "skip_reduce":
        node_path.dist.reduce = lambda *a, **k: None
    return lambda: (setattr(node_path.SpanningWeights, "gather", gather), setattr(node_path.dist, "reduce", reduce))


def main() -> None:
    out, args = Path(sys.argv[1]), json.loads(sys.argv[2])
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    results = {}
    for run in args["runs"]:
        undo = control(run)
        try:
            one = {**args, "run": run, "budget": args.get("budgets", {}).get(run),
                   "bf16": run.startswith(("bf16", "hilo")), "overlap": run == "overlap",
                   "master": "hilo" if run.startswith("hilo") else "bf16" if run.startswith("bf16m") else "auto",
                   "path": "per_rank" if run.endswith("_whole") else "auto"}
            if run == "deepspeed":  # the DeepSpeed face: save_checkpoint after the first step, a fresh engine loads it
                results[run] = deepspeed_face({**one, "save": str(out / "ds_checkpoint")})
                results["deepspeed_resumed"] = deepspeed_face({**one, "load": str(out / "ds_checkpoint")})
            elif run == "resume":  # the first half, saved (every rank calls both state_dicts); a fresh engine loads it
                ckpt = out / "checkpoint.pt"
                half = args["steps"] // 2
                first = train({**one, "stop": half, "save": str(ckpt)})
                rest = train({**one, "start": half, "load": str(ckpt)})
                results[run] = {**rest, "losses": first["losses"] + rest["losses"],
                                "norms": first["norms"] + rest["norms"]}
            else:
                results[run] = train(one)
        except (HostMemoryError, ValueError) as exc:
            results[run] = {"refused": f"{type(exc).__name__}: {exc}"}
        finally:
            undo()
    torch.save(results, out / f"rank{rank}.pt")


def deepspeed_face(args: dict) -> dict:
    """The DeepSpeed face as users drive it: `megatrain.initialize`, then per micro-batch engine(...), backward, step;
    with "save", `save_checkpoint` (every rank) after the first optimizer step, training on to the end; with "load",
    a fresh engine's `load_checkpoint` of it and the steps after. Each micro-batch's loss (this rank's), each
    step's pre-clip norm and the final weights (the state_dict, collective)."""
    import megatrain

    rank, micro = int(os.environ.get("RANK", "0")), args["micro"]
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": ACCUM, "gradient_clipping": CLIP,
           "optimizer": {"type": "AdamW", "params": {"lr": LR}},
           "megatrain": {"device": "cpu", "parity_probe": False, "residency": "stream", "watchdog_s": 120.0,
                         "speculative_step": False, "host_budget_bytes": args["budget"]}}
    model = build_model(args["layers"], args["intermediate"])
    engine, _, _, _ = megatrain.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    if args.get("load"):
        engine.load_checkpoint(args["load"])
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, VOCAB, (args["world"] * micro * args["steps"] * ACCUM, SEQ), generator=g)
    losses, norms = [], []
    for j in range(engine.global_steps * ACCUM, args["steps"] * ACCUM):
        at = (j * args["world"] + rank) * micro
        ids = rows[at: at + micro]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        if (j + 1) % ACCUM == 0:
            norms.append(engine.get_global_grad_norm())
            if args.get("save") and j + 1 == ACCUM:
                engine.save_checkpoint(args["save"])
    state = {k: v.detach().clone() for k, v in engine.state_dict().items()}
    return {"losses": losses, "norms": norms, "state": state, "data_path": engine.engine.data_path.describe()}


def own_bytes(engine: Engine) -> int:
    """This rank's host bytes outside the node's shared memory: its slabs of the layers it owns, the resident
    parameters' buffers, the one-layer update scratch and its optimizer's state (each storage once)."""
    store = engine.store
    total = sum(g.grad.numel() * g.grad.element_size() for g in store.layers if g.grad is not None)
    total += sum(t.numel() * t.element_size() for t in store.globals.host_tensors() if t.device.type == "cpu")
    if store.scratch is not None:
        total += sum(t.numel() * t.element_size() for t in (store.scratch.master, store.scratch.grad) if t is not None)
    seen = {}
    for st in engine.optimizer.state.values():
        for t in st.values():
            if torch.is_tensor(t) and t.device.type == "cpu":
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return total + sum(seen.values())


def train(args: dict) -> dict:
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    micro, steps = args["micro"], args["steps"]
    refused = REFUSALS.get(args["run"], {})
    cuda_auto = args["run"] == "cuda_auto"
    spec = args["run"] in SPEC_RUNS
    if spec:
        steps = len(SPEC_CLIPS)
        refused = {"speculative_step": args["run"] != "spec_serial"}
    cfg = EngineConfig(**{"device": "cpu", "parity_probe": False, "residency": "stream", "watchdog_s": 120.0,
                          "speculative_step": "auto" if cuda_auto else False,
                          "data_parallel_path": args.get("path", "auto"),
                          "host_master": args.get("master", "auto"), **refused},
                       compute_dtype="bfloat16" if args["bf16"] else "float32",
                       host_budget_bytes=args["budget"], optimizer_overlap=None if cuda_auto else args["overlap"])
    if cuda_auto:  # the plan a CUDA device settles the defaults to: pinned, overlapped, speculative "if it fits"
        cfg = settle_engine(cfg, EngineFacts("cuda"))[0]
    model = build_model(args["layers"], args["intermediate"])
    for name, p in model.named_parameters():  # "frozen": node 0's layer 1 whole and one weight of node 1's layer 7
        if args["run"] == "frozen" and name.startswith(FROZEN):
            p.requires_grad_(False)
    engine = Engine(model, cfg, optimizer=lambda named: torch.optim.AdamW([p for _, p in named], lr=LR))
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
            poison = spec and s == SPEC_NAN_STEP and j == ACCUM - 1 and rank == 0
            engine.backward(loss * float("nan") / ACCUM if poison else loss / ACCUM)
            if spec and refused["speculative_step"]:
                engine.update.layered.synchronize()  # every speculation runs before the next forward or the step
            got = loss.detach().clone()
            if world > 1:
                dist.all_reduce(got)  # the global batch's mean loss: every rank's rows have equal label tokens
                got /= world
            losses.append(float(got))
        norms.append(float(engine.clip_grad_norm_(SPEC_CLIPS[s] if spec else CLIP)))
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
    node = engine.node
    state = {k: v.detach().clone() for k, v in engine.state_dict().items()}  # collective: every layer
    spans = getattr(node, "spans_nodes", False)
    extra = {}
    if args["run"] in args.get("extras", ()):
        # on every rank, the same rows: an evaluation forward (the layers from their owner nodes, joined first) and
        # the model object's state_dict() (the other nodes' layers gathered from their owners)
        model = engine.module
        model.eval()
        with torch.no_grad():
            extra["eval_logits"] = engine(input_ids=rows[:1], return_logits=True).logits.detach().clone()
        extra["model_state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.train()
    if cuda_auto:  # the registrations the store made, and the storage the other nodes' layers view
        other = [g for i, g in enumerate(engine.store.layers) if spans and not node.node_owns(i)]
        extra["pinned"] = list(PINNED)
        extra["scratch_ptr"] = other[0].stream_source.untyped_storage().data_ptr() if other else None
        extra["plan"] = (engine.config.pin_memory, engine.config.optimizer_overlap)
    if spec:
        extra["adam"] = {k: {n: t.clone() if torch.is_tensor(t) else t for n, t in v.items()}
                         for k, v in engine.optimizer.state_dict()["state"].items() if v}
        extra["skipped"] = engine.skipped_steps
    return {**extra, "losses": losses, "norms": norms, "stats": stats, "state": state,
            "data_path": engine.data_path.describe(),
            "node": node.topo.node if node is not None else 0,
            "node_layers": [i for i in range(len(engine.store.layers)) if node.node_owns(i)] if spans else None,
            "shm_bytes": node.shm_bytes if spans else None, "own_bytes": own_bytes(engine)}


if __name__ == "__main__":
    main()
