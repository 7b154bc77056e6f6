"""One rank of tests/integration/test_dp_speculative.py: the speculative step with 2 gloo ranks, a tiny Llama on the
CPU device with every layer streamed, accumulation 2, against the same ranks' serial step, on each data path.

Each step's clip is set so that it scales at some steps and not at others (a speculation rolled back, or held), and
one step's gradients are made non-finite on rank 0 (its second micro-batch's loss times NaN: the ranks' sum is NaN
everywhere, the step skipped). Rank r of W takes rows [(j*W + r)*b, (j*W + r + 1)*b) of global micro-batch j.

Run under torchrun as `python tests/workers/dp_speculative_worker.py OUT_DIR JSON_ARGS`; JSON_ARGS: micro, steps,
layers, runs (each "PATH:MODE[:CONTROL]"; PATH "per_rank" (the node's shared store, each layer's owner updating it
whole), "replicated" (each rank its own store, the ranks' average) or "node" (the node path's update by shard);
MODE "serial" (speculative_step=False), "spec" (True) or "auto" (True, with "auto"'s back-off, which a CPU device
otherwise settles off); VARIANT "race" (the speculative jobs not waited for after each backward: which layers a
step finds speculated is the host's timing), "overlap" (optimizer_overlap: the step returns with the layer updates
queued, each layer's next load waiting for them), "slow" (rank 0's restores start late) or a negative control
(`control`)); and a precision, "bf16" (bf16 compute, FP32 masters) or "hilo" (bf16 compute, host_master "hilo"),
FP32 compute without (e.g. "per_rank:spec:norollback:bf16"). Writes OUT_DIR/rank{r}.pt:
per run, each micro-batch's loss (the global batch's), each step's pre-clip norm, the final weights (state_dict)
and Adam state of this rank's optimizer, and the speculative step's counts.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatrain.config.schema import EngineConfig
from megatrain.engine import Engine
from megatrain.engine.update.speculative import Speculative, StateCopy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from node_path_worker import build_model  # noqa: E402 - the node path test's model (the same vocabulary)

VOCAB, SEQ, LR = 128, 12, 1e-3
# Per step: a clip that scales (0.05 against norms of about 1: rolled back), none that does (1e9: held).
CLIPS = [1e9, 0.05, 1e9, 0.05, 1e9]
NAN_STEP = 2  # its clip would scale nothing: the skip, not the clip, rolls it back
SLOW_RESTORE_S = 0.5  # "slow": each of rank 0's restores starts this late
# The GPU's default compute dtype, with FP32 or the exact split (hilo) masters: the rollback restores what they hold.
PRECISIONS = {"": {"compute_dtype": "float32"}, "bf16": {"compute_dtype": "bfloat16", "host_master": "fp32"},
              "hilo": {"compute_dtype": "bfloat16", "host_master": "hilo"}}
PATHS = {"per_rank": {"data_parallel_path": "per_rank"},
         "replicated": {"data_parallel_path": "per_rank", "data_parallel_host": "replicated"},
         "node": {"data_parallel_path": "node"}}


def control(name: str, rank: int):
    """The negative control `name` on this rank; returns what undoes it. "norollback": rank 1's rollback copies are
    never written back (its speculated layers stay as the speculation left them); "wholecopy": on the node path each
    rank's rollback copy is of the whole layer, not of its ranges (a restore writes the other rank's ranges too);
    "slow_unmet": on the shared store, rank 0's restores start late and a discard does not meet the other ranks (the
    other rank's next forward loads rank 0's layers as the speculation left them). "slow" (no control): the late
    restores alone, which the discard's meeting of the ranks waits for."""
    if name == "norollback" and rank == 1:
        restore = StateCopy.restore
        StateCopy.restore = lambda self, group, view: None
        return lambda: setattr(StateCopy, "restore", restore)
    if name.startswith("slow") and rank == 0:  # "slow", "slow_unmet": rank 0's restores start late
        restore = StateCopy.restore

        def late(self, group, view) -> None:
            time.sleep(SLOW_RESTORE_S)
            restore(self, group, view)

        StateCopy.restore = late
        return lambda: setattr(StateCopy, "restore", restore)
    if name == "wholecopy":
        init = StateCopy.__init__
        StateCopy.__init__ = lambda self, ranges=None: init(self, None)
        return lambda: setattr(StateCopy, "__init__", init)
    return lambda: None


def train(args: dict, path: str, mode: str, variant: str = "", precision: str = "") -> dict:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    micro, steps, accum = args["micro"], args["steps"], 2
    cfg = EngineConfig(**{"device": "cpu", "parity_probe": False, "residency": "stream", "watchdog_s": 120.0,
                          **PRECISIONS[precision], "speculative_step": mode != "serial", **PATHS[path],
                          "optimizer_overlap": variant == "overlap"})
    model = build_model(args["layers"])
    engine = Engine(model, cfg, optimizer=lambda named: torch.optim.AdamW([p for _, p in named], lr=LR))
    spec = engine.update if isinstance(engine.update, Speculative) else None
    assert (spec is not None) == (mode != "serial"), type(engine.update)
    if variant == "slow_unmet":
        spec._shares = False  # the control: a discard that does not wait for the other ranks' restores
    if mode == "auto":
        spec.back_off = True  # speculative_step "auto"'s back-off (engine's speculation_backs_off), on a CPU device
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, VOCAB, (world * micro * steps * accum, SEQ), generator=g)
    losses, norms = [], []
    for s in range(steps):
        for j in range(accum):
            at = (s * accum + j) * world * micro + rank * micro
            ids = rows[at: at + micro]
            loss = engine(input_ids=ids, labels=ids).loss
            poison = s == NAN_STEP and j == accum - 1 and rank == 0
            engine.backward(loss * float("nan") / accum if poison else loss / accum)
            if spec is not None and variant != "race":
                # The speculative updates queued done before what follows (a forward, the clip): every speculation
                # runs, so which layers roll back is the verdicts', not the host's timing.
                spec.layered.synchronize()
            got = loss.detach().clone()
            dist.all_reduce(got)  # the global batch's mean loss: every rank's rows have equal label tokens
            losses.append(float(got) / world)
        norms.append(float(engine.clip_grad_norm_(CLIPS[s % len(CLIPS)])))
        engine.step()
        engine.zero_grad()
    engine.synchronize()
    stats = engine.collect_stats()
    state = {k: v.detach().clone() for k, v in engine.state_dict().items()}
    adam = {k: {n: t.clone() if torch.is_tensor(t) else t for n, t in v.items()}
            for k, v in engine.optimizer.state_dict()["state"].items() if v}
    return {"losses": losses, "norms": norms, "state": state, "adam": adam,
            "rollbacks": stats["speculative_rollbacks"], "backoffs": stats["speculative_backoffs"],
            "layers": stats["speculative_layers"], "skipped": engine.skipped_steps,
            "kept": spec.kept_layers if spec is not None else 0,
            "quiet": spec.quiet_steps if spec is not None else 0,
            "data_path": engine.data_path.describe(), "compute_dtype": str(engine.compute_dtype).split(".")[-1],
            # what the store holds, not what was asked: a layer's 16-bit "lo" remainder is the hilo master's
            "host_master": "hilo" if engine.store.layers[0].lo is not None else "fp32"}


def main() -> None:
    out, args = Path(sys.argv[1]), json.loads(sys.argv[2])
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    results = {}
    for run in args["runs"]:
        path, mode, *rest = run.split(":")
        precision = "".join(t for t in rest if t in PRECISIONS)
        variant = "".join(t for t in rest if t not in PRECISIONS)
        undo = control(variant, rank)
        try:
            results[run] = train(args, path, mode, variant, precision)
        finally:
            undo()
    torch.save(results, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
