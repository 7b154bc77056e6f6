"""Fine-tune a causal language model with 🤗 Accelerate, in the style of accelerate's and transformers' own
examples (`run_clm_no_trainer.py`): argparse, `get_logger`, `set_seed`, `accelerator.state`, `get_scheduler`
through `prepare`, `accumulate`, evaluation through `gather_for_metrics`, `--checkpointing_steps` /
`--resume_from_checkpoint` with `save_state` / `load_state`, and the usual final save.

A tiny random Llama on random tokens keeps it self-contained (no downloads). The one MegaTrain line is the import:
`--megatrain` (or MEGATRAIN_FACE=1) takes `from megatrain import Accelerator` and `backend="megatrain"` instead
of `from accelerate import Accelerator`, which is the only edit a user makes. Run it under `python`, `torchrun`
or `accelerate launch` (with a DeepSpeed config whose "megatrain" section puts MegaTrain behind accelerate's
DeepSpeed road, unchanged).

`--report DIR` writes what the tests compare: each rank's micro-batch losses, batches (a fingerprint of each),
learning rates after each optimizer step, and the evaluation (report_rank<r>.json), plus the engine's weights
at the end as the model holds them (final_weights.pt, main process).
"""

import argparse
import json
import math
import os

import torch
import transformers
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset
from transformers import get_scheduler

logger = get_logger(__name__)


def parse_args():
    parser = argparse.ArgumentParser(description="Fine-tune a causal LM with Accelerate")
    parser.add_argument("--megatrain", action="store_true", default=os.environ.get("MEGATRAIN_FACE") == "1",
                        help="train with `from megatrain import Accelerator` (backend='megatrain')")
    parser.add_argument("--output_dir", type=str, required=True)
    parser.add_argument("--per_device_train_batch_size", type=int, default=2)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=2)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--weight_decay", type=float, default=0.0)
    parser.add_argument("--num_train_epochs", type=int, default=1)
    parser.add_argument("--max_train_steps", type=int, default=30)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--lr_scheduler_type", type=str, default="linear")
    parser.add_argument("--num_warmup_steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--block_size", type=int, default=32)
    parser.add_argument("--num_train_rows", type=int, default=240)
    parser.add_argument("--checkpointing_steps", type=str, default=None,
                        help="save the state every n optimizer steps, or 'epoch'")
    parser.add_argument("--resume_from_checkpoint", type=str, default=None)
    parser.add_argument("--report", type=str, default=None)
    return parser.parse_args()


class RandomTokens(Dataset):
    """Rows of random tokens (every third one padded on the left), labels the inputs (padding ignored)."""

    def __init__(self, rows: int, block_size: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (rows, block_size), generator=g)
        self.mask = torch.ones_like(self.ids)
        self.mask[::3, : block_size // 4] = 0
        self.labels = self.ids.masked_fill(self.mask == 0, -100)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


def main():
    args = parse_args()

    # The only change a user makes: the import, and the backend.
    if args.megatrain:
        from megatrain import Accelerator
        accelerator_kwargs = {"backend": "megatrain"}
    else:
        from accelerate import Accelerator
        accelerator_kwargs = {}
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps, **accelerator_kwargs)
    # The state as accelerate made it, before anything ran (test_accelerate_scripts.py reads it on the DeepSpeed road)
    made = {"num_processes": accelerator.num_processes, "process_index": accelerator.process_index,
            "distributed_type": str(accelerator.distributed_type), "backend": accelerator.state.backend,
            "group": torch.distributed.get_world_size() if torch.distributed.is_initialized() else None}
    logger.info(accelerator.state, main_process_only=False)
    if accelerator.state.deepspeed_plugin is not None:
        logger.info("DeepSpeed config: %s", accelerator.state.deepspeed_plugin.deepspeed_config)

    set_seed(args.seed)
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
    accelerator.wait_for_everyone()

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=128)
    model = transformers.AutoModelForCausalLM.from_config(config)

    train_dataset = RandomTokens(args.num_train_rows, args.block_size, config.vocab_size, seed=1)
    eval_dataset = RandomTokens(16, args.block_size, config.vocab_size, seed=2)
    train_dataloader = DataLoader(train_dataset, shuffle=True, batch_size=args.per_device_train_batch_size)
    eval_dataloader = DataLoader(eval_dataset, batch_size=args.per_device_eval_batch_size)

    no_decay = ["bias", "layer_norm.weight", "norm.weight"]
    optimizer_grouped_parameters = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate)

    # As accelerate's examples: the prepared scheduler steps once per process per optimizer step.
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    overrode_max_train_steps = args.max_train_steps is None
    if overrode_max_train_steps:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    lr_scheduler = get_scheduler(
        name=args.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
        num_training_steps=args.max_train_steps if overrode_max_train_steps
        else args.max_train_steps * accelerator.num_processes,
    )

    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )

    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    args.num_train_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)
    checkpointing_steps = args.checkpointing_steps
    if checkpointing_steps is not None and checkpointing_steps.isdigit():
        checkpointing_steps = int(checkpointing_steps)

    total_batch_size = args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    logger.info("***** Running training *****")
    logger.info(f"  Num examples = {len(train_dataset)}")
    logger.info(f"  Total train batch size (w. parallel, distributed & accumulation) = {total_batch_size}")
    logger.info(f"  Total optimization steps = {args.max_train_steps}")
    completed_steps = 0
    starting_epoch = 0
    resume_step = None

    if args.resume_from_checkpoint:
        checkpoint_path = args.resume_from_checkpoint
        path = os.path.basename(checkpoint_path.rstrip("/"))
        accelerator.print(f"Resumed from checkpoint: {checkpoint_path}")
        accelerator.load_state(checkpoint_path)
        training_difference = os.path.splitext(path)[0]
        if "epoch" in training_difference:
            starting_epoch = int(training_difference.replace("epoch_", "")) + 1
            resume_step = None
            completed_steps = starting_epoch * num_update_steps_per_epoch
        else:
            resume_step = int(training_difference.replace("step_", "")) * args.gradient_accumulation_steps
            starting_epoch = resume_step // len(train_dataloader)
            completed_steps = resume_step // args.gradient_accumulation_steps
            resume_step -= starting_epoch * len(train_dataloader)

    report = {"losses": [], "batches": [], "lrs": [], "start_step": completed_steps}
    for epoch in range(starting_epoch, args.num_train_epochs):
        model.train()
        if args.resume_from_checkpoint and epoch == starting_epoch and resume_step is not None:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        for batch in active_dataloader:
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            report["losses"].append(loss.item())
            report["batches"].append(int((batch["input_ids"] * (1 + torch.arange(args.block_size))).sum()))
            if accelerator.sync_gradients:
                completed_steps += 1
                report["lrs"].append(lr_scheduler.get_last_lr()[0])
            if isinstance(checkpointing_steps, int):
                if completed_steps % checkpointing_steps == 0 and accelerator.sync_gradients:
                    accelerator.save_state(os.path.join(args.output_dir, f"step_{completed_steps}"))
            if completed_steps >= args.max_train_steps:
                break

        model.eval()
        losses = []
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**batch)
            loss = outputs.loss
            losses.append(accelerator.gather_for_metrics(loss.repeat(args.per_device_eval_batch_size)))
        losses = torch.cat(losses)
        try:
            eval_loss = torch.mean(losses)
            perplexity = math.exp(eval_loss)
        except OverflowError:
            perplexity = float("inf")
        logger.info(f"epoch {epoch}: perplexity: {perplexity} eval_loss: {eval_loss}")
        report["eval_loss"], report["perplexity"] = eval_loss.item(), perplexity

        if args.checkpointing_steps == "epoch":
            accelerator.save_state(os.path.join(args.output_dir, f"epoch_{epoch}"))

    if args.output_dir is not None:
        accelerator.wait_for_everyone()
        unwrapped_model = accelerator.unwrap_model(model)
        unwrapped_model.save_pretrained(
            args.output_dir, is_main_process=accelerator.is_main_process, save_function=accelerator.save,
            state_dict=accelerator.get_state_dict(model),
        )
    if args.report is not None:
        os.makedirs(args.report, exist_ok=True)
        report.update(state=made, num_processes=accelerator.num_processes, accelerator=type(accelerator).__module__,
                      distributed_type=str(accelerator.distributed_type), prepared=type(model).__name__,
                      unwrapped=type(accelerator.unwrap_model(model)).__name__)
        with open(os.path.join(args.report, f"report_rank{accelerator.process_index}.json"), "w") as f:
            json.dump(report, f)
        if accelerator.is_main_process:
            # The weights as the trained model holds them (on MegaTrain: the engine's FP32 masters).
            weights = {n: p.detach().float().clone() for n, p in accelerator.unwrap_model(model).named_parameters()}
            torch.save(weights, os.path.join(args.report, "final_weights.pt"))
    accelerator.end_training()


if __name__ == "__main__":
    main()
