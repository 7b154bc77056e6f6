"""Data-parallel training with the megatrain backend, through both faces, on a tiny Llama.

    torchrun --nproc-per-node 2 examples/train_data_parallel.py --micro-batch 2 --out runs/dp2
    python examples/train_data_parallel.py --micro-batch 4 --out runs/dp1      # the same global batch

Each rank streams the layers through its own device (here the CPU) and the engine averages every
layer's gradients across ranks as they leave backward (gloo on the CPU). Both commands print the same
per-micro-batch losses (of the global batch) and end with the same weights: rank r of N takes rows
[(j*N + r)*b, (j*N + r + 1)*b) of global micro-batch j, which is what a one-process run with
micro-batch N*b takes whole. Every row has the same number of label tokens, so the mean of the ranks'
mean losses is the mean over the global batch (the rule DDP and DeepSpeed average by).
With --out, each rank writes its losses, pre-clip gradient norms and final weights to OUT/rank{r}.pt.

Checkpoints move between world sizes: --save-to DIR writes each face's state at the end (the DeepSpeed
face's `save_checkpoint` into DIR, the accelerator face's `save_state` into DIR/accelerator) and
--resume-from DIR continues it up to --steps, on any number of ranks. Keep the global batch (ranks x
--micro-batch) the same across the resume, or the continued run trains on another batch size:

    torchrun --nproc-per-node 2 examples/train_data_parallel.py --micro-batch 3 --steps 3 --save-to runs/ck
    torchrun --nproc-per-node 3 examples/train_data_parallel.py --micro-batch 2 --steps 5 --resume-from runs/ck
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch
import transformers

VOCAB, SEQ, LR, CLIP = 128, 12, 1e-3, 0.05
SCHEDULE_STEPS = 8  # the LR schedule's length, whatever a run's --steps (a resumed run continues it)


def build_model(seed: int = 0) -> torch.nn.Module:
    # A different seed on every rank: the engine must start all ranks from rank 0's weights.
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(cfg)


def checkpoint_dir(root: Path, face: str) -> Path:
    """Where a face's checkpoint lives under a --save-to / --resume-from root (DeepSpeed's: the root itself)."""
    return root if face == "deepspeed" else root / "accelerator"


class Progress:
    """Micro-batches trained so far, saved with the accelerator's state so a resumed run knows where its
    data continues (Accelerate checkpoints objects registered with `register_for_checkpointing`)."""

    def __init__(self) -> None:
        self.micro_batches = 0

    def state_dict(self) -> dict[str, int]:
        return {"micro_batches": self.micro_batches}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.micro_batches = int(state["micro_batches"])


class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int = 1) -> None:
        # Drawn from one pool, so row i is the same whatever n (a resumed run reads the rows that follow).
        pool = torch.randint(0, VOCAB, (max(n, 512), SEQ), generator=torch.Generator().manual_seed(seed))
        self.ids = pool[:n]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def engine_section(watchdog_s: float) -> dict[str, Any]:
    # The architecture is proven by the parity probe's own tests; ranks would race on its cache here.
    return {"parity_probe": False, "watchdog_s": watchdog_s, "device": "cpu"}


def train(face: str, micro: int, world: int, rank: int, steps: int = 3, accumulation: int = 2,
          watchdog_s: float = 60.0, save_to: Path | None = None, resume_from: Path | None = None,
          backend: str = "megatrain", leave_out: str | None = None) -> dict[str, Any]:
    """Per-micro-batch losses, per-step pre-clip norms and the final weights of this rank, after `steps`
    optimizer steps. Both faces: `save_to` writes this face's checkpoint (that directory itself) at the end;
    `resume_from` continues one, written with any number of ranks, up to `steps`, and the losses and norms
    are the resumed part's. `leave_out` ("optimizer" or "scheduler") resumes without that part of the
    checkpoint: a broken resume, for the tests' negative control.
    Accelerator face: `backend` may be "zero3" (real DeepSpeed ZeRO-3 offload over the same ranks)."""
    if leave_out not in (None, "optimizer", "scheduler"):
        raise ValueError(f"leave_out={leave_out!r}")
    model = build_model(seed=rank)
    n_micro = steps * accumulation
    data = Rows(n_micro * micro * world)
    losses: list[float] = []
    norms: list[float] = []
    if face == "deepspeed":
        import megatrain

        cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accumulation,
               "gradient_clipping": CLIP,
               "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
               "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR,
                                                                 "warmup_num_steps": 2,
                                                                 "total_num_steps": SCHEDULE_STEPS}},
               # The host AdamW a layer at a time behind the next forward: each update waits for that layer's
               # average across ranks (the same math as the whole step).
               "megatrain": {**engine_section(watchdog_s), "optimizer_overlap": True}}
        engine, _, _, _ = megatrain.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        assert engine.train_batch_size() == micro * accumulation * world
        if resume_from is not None:
            engine.load_checkpoint(resume_from, load_optimizer_states=leave_out != "optimizer",
                                   load_lr_scheduler_states=leave_out != "scheduler")
        for j in range(engine.global_steps * accumulation, n_micro):
            # Global micro-batch j is rows [j*G, (j+1)*G), G = world*micro; this rank takes its slice.
            start = (j * world + rank) * micro
            batch = data.ids[start: start + micro]
            loss = engine(input_ids=batch, labels=batch).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if (j + 1) % accumulation == 0:
                norms.append(engine.get_global_grad_norm())
        state = engine.state_dict()
        if save_to is not None:
            engine.save_checkpoint(save_to)
    elif face == "accelerator":
        from accelerate.utils import DataLoaderConfiguration

        from megatrain import Accelerator
        from megatrain.config.schema import EngineConfig

        # ZeRO-3 fills in its own CPU-offload config (baselines/zero3.py).
        config = EngineConfig(**engine_section(watchdog_s)) if backend == "megatrain" else None
        # split_batches: each loader batch is a global micro-batch, rank r taking its r-th slice (the rows the
        # DeepSpeed face's ranks take), and accelerate's scheduler steps once per optimizer step whatever the
        # world size (without it, once per process per step), so a checkpoint resumes on any number of ranks.
        acc = Accelerator(backend=backend, config=config, gradient_accumulation_steps=accumulation,
                          dataloader_config=DataLoaderConfiguration(split_batches=True))
        assert acc.num_processes == world and acc.process_index == rank
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        loader = torch.utils.data.DataLoader(data, batch_size=micro * world, shuffle=False)
        model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
        progress = Progress()
        acc.register_for_checkpointing(progress)
        if resume_from is not None:
            # A fresh run's state, put back after loading to leave that part out (the negative control).
            fresh = {"optimizer": opt, "scheduler": sched}[leave_out].state_dict() if leave_out else None
            acc.load_state(resume_from)
            if leave_out:
                {"optimizer": opt, "scheduler": sched}[leave_out].load_state_dict(fresh)
            # skip_first_batches counts this rank's batches: one per global micro-batch, whatever the world.
            loader = acc.skip_first_batches(loader, progress.micro_batches)
        assert len(loader) == n_micro - progress.micro_batches
        for batch in loader:
            with acc.accumulate(model):
                loss = model(**batch).loss
                acc.backward(loss)
                if acc.sync_gradients:
                    norms.append(float(acc.clip_grad_norm_(model.parameters(), CLIP)))
                opt.step()
                sched.step()
                opt.zero_grad()
            losses.append(loss.item())
            progress.micro_batches += 1
        state = acc.get_state_dict(model)
        if save_to is not None:
            # Every rank calls it, as Accelerate scripts do; it returns once the folder is whole on all ranks.
            acc.save_state(save_to)
    else:
        raise ValueError(face)
    return {"losses": losses, "norms": norms, "state": {k: v.detach().clone() for k, v in state.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--faces", nargs="+", default=["deepspeed", "accelerator"], choices=["deepspeed", "accelerator"])
    ap.add_argument("--micro-batch", type=int, default=2, help="rows per rank per micro-batch")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--accumulation", type=int, default=2)
    ap.add_argument("--watchdog-s", type=float, default=60.0)
    ap.add_argument("--backend", default="megatrain", choices=["megatrain", "zero3"], help="the accelerator face's")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--save-to", type=Path, default=None,
                    help="checkpoint root written at the end (DeepSpeed face: the root; accelerator: ROOT/accelerator)")
    ap.add_argument("--resume-from", type=Path, default=None,
                    help="continue the checkpoints of a --save-to root (any world size) up to --steps")
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = run(args.faces, args.micro_batch, args.steps, args.accumulation, args.watchdog_s, args.save_to,
                  args.backend, args.resume_from)
    if int(os.environ.get("RANK", "0")) == 0:
        for face, r in results.items():
            print(face, "losses", " ".join(f"{x:.6f}" for x in r["losses"]))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save(results, args.out / f"rank{int(os.environ.get('RANK', '0'))}.pt")
    if torch.distributed.is_initialized():
        # Tear the ranks' group down together here rather than in each interpreter's exit, where a rank whose
        # communication threads are still being torn down can abort ("terminate called without an active exception").
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def run(faces: list[str], micro: int, steps: int, accumulation: int, watchdog_s: float,
        save_to: Path | None = None, backend: str = "megatrain", resume_from: Path | None = None,
        leave_out: str | None = None) -> dict[str, Any]:
    """Train once per face; the losses come back as the global batch's (the mean over the ranks).
    `save_to` / `resume_from` are checkpoint roots holding both faces' checkpoints (`checkpoint_dir`)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    results = {}
    for face in faces:
        r = train(face, micro, world, rank, steps, accumulation, watchdog_s,
                  None if save_to is None else checkpoint_dir(save_to, face),
                  None if resume_from is None else checkpoint_dir(resume_from, face), backend, leave_out)
        if world > 1:
            losses = torch.tensor(r["losses"], dtype=torch.float64)
            torch.distributed.all_reduce(losses)
            r["losses"] = (losses / world).tolist()
        results[face] = r
    return results


if __name__ == "__main__":
    main()
