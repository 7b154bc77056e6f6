"""accelerate's `nlp_example` loop on MegaTrain: the upstream script with `megatrain.Accelerator` for
`accelerate.Accelerator` and a `backend=` argument (lines marked "MegaTrain").

    python examples/accelerate_nlp.py --project_dir out --backend megatrain   # or torch, or zero3
    python examples/accelerate_nlp.py --project_dir out --backend megatrain --resume   # continue from the newest

Training with gradient accumulation and a linear warm-up schedule, evaluation each epoch (loss and
next-token accuracy through gather_for_metrics), tracking (a JSON-lines tracker here: accelerate's
GeneralTracker API), automatically named checkpoints every `--checkpoint_every` batches with a
`total_limit`, and resuming mid-epoch with skip_first_batches. A tiny random Llama on random tokens keeps
it self-contained; swap in your model and data. `--report FILE` writes the losses and metrics as JSON.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import transformers
from accelerate.tracking import GeneralTracker
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed

from megatrain import Accelerator  # MegaTrain: instead of `from accelerate import Accelerator`


class JsonlTracker(GeneralTracker):
    """Appends each log() call to <logging_dir>/log.jsonl."""

    name = "jsonl"
    requires_logging_directory = True

    def __init__(self, logging_dir: str) -> None:
        super().__init__()
        self.path = os.path.join(logging_dir, "log.jsonl")

    @property
    def tracker(self) -> str:
        return self.path

    def store_init_configuration(self, values: dict) -> None:
        self.log({"config": values})

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **values}) + "\n")


class Progress:
    """Where the loop is, saved with the checkpoints (register_for_checkpointing)."""

    def __init__(self) -> None:
        self.epoch, self.batch = 0, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.batch = state["epoch"], state["batch"]


def get_dataloaders(batch_size: int) -> tuple[torch.utils.data.DataLoader, torch.utils.data.DataLoader]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (24, 16), generator=g)
    rows = [{"input_ids": r, "attention_mask": torch.ones_like(r), "labels": r} for r in ids]
    train = torch.utils.data.DataLoader(rows[:16], batch_size=batch_size, shuffle=True,
                                        generator=torch.Generator().manual_seed(2))
    evaluate = torch.utils.data.DataLoader(rows[16:], batch_size=batch_size)
    return train, evaluate


def training_function(a: argparse.Namespace) -> dict:
    hparams = {"lr": 1e-3, "num_epochs": a.epochs, "seed": 42, "batch_size": 2}
    project = ProjectConfiguration(project_dir=a.project_dir, automatic_checkpoint_naming=True, total_limit=2)
    tracker = JsonlTracker(os.path.join(a.project_dir, "logs"))
    accelerator = Accelerator(backend=a.backend,  # MegaTrain: pick the backend
                              cpu=a.cpu, mixed_precision=a.mixed_precision, gradient_accumulation_steps=2,
                              log_with=tracker, project_config=project,
                              # accelerate's sampler whose order is a function of (seed, epoch), saved with the
                              # state (sampler.bin): a mid-epoch resume replays the same order
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    accelerator.init_trackers("nlp_example", config=hparams)
    set_seed(hparams["seed"])
    train_dl, eval_dl = get_dataloaders(hparams["batch_size"])
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=hparams["lr"])
    steps = hparams["num_epochs"] * len(train_dl) // accelerator.gradient_accumulation_steps
    lr_scheduler = transformers.get_linear_schedule_with_warmup(optimizer, num_warmup_steps=1,
                                                                num_training_steps=steps)
    model, optimizer, train_dl, eval_dl, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dl, eval_dl, lr_scheduler)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if a.resume:
        accelerator.load_state()  # the newest automatically named checkpoint
        # as with accelerate, numbering continues where the user says
        newest = max(int(name.split("_")[-1]) for name in os.listdir(os.path.join(a.project_dir, "checkpoints")))
        accelerator.project_configuration.iteration = newest + 1

    losses, metrics = [], []
    for epoch in range(progress.epoch, hparams["num_epochs"]):
        model.train()
        train_dl.set_epoch(epoch)  # the seedable sampler's order for this epoch, resumed or not
        start = progress.batch if epoch == progress.epoch else 0
        loader = accelerator.skip_first_batches(train_dl, start) if start else train_dl
        for batch_index, batch in enumerate(loader, start=start):
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            losses.append(loss.item())
            progress.epoch, progress.batch = epoch, batch_index + 1
            if progress.batch % a.checkpoint_every == 0:
                accelerator.save_state()
        progress.epoch, progress.batch = epoch + 1, 0

        model.eval()
        total, correct, count = 0.0, 0, 0
        for batch in eval_dl:
            with torch.no_grad():
                out = model(**batch)
            predictions = out.logits[:, :-1].argmax(-1)
            references = batch["labels"][:, 1:]
            predictions, references = accelerator.gather_for_metrics((predictions, references))
            correct += (predictions == references).sum().item()
            count += references.numel()
            total += out.loss.item()
        metrics.append({"eval_loss": total / len(eval_dl), "accuracy": correct / count})
        accelerator.log({**metrics[-1], "train_loss": losses[-1]}, step=epoch)
    accelerator.end_training()
    report = {"losses": losses, "metrics": metrics}
    if a.report:
        with open(a.report, "w") as f:
            json.dump(report, f)
    return report


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--project_dir", required=True)
    p.add_argument("--backend", choices=["megatrain", "zero3", "torch"], default="megatrain")
    p.add_argument("--mixed_precision", choices=["no", "bf16"], default="no")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--checkpoint_every", type=int, default=3)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--report", default=None)
    return training_function(p.parse_args(argv))


if __name__ == "__main__":
    main()
