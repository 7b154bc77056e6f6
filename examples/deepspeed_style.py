"""A plain DeepSpeed training script on MegaTrain: one line differs from its DeepSpeed form (marked "MegaTrain").

    python examples/deepspeed_style.py --deepspeed_config ds_config.json   # JSON or hjson, as DeepSpeed reads
    python examples/deepspeed_style.py                                      # the config below

A tiny randomly initialised Llama on random tokens keeps it self-contained; swap in your model and data.
`--report FILE` writes the per-micro-batch losses and the learning rates as JSON.
"""

from __future__ import annotations

import argparse
import json

import torch
import transformers

import megatrain as deepspeed  # MegaTrain: instead of `import deepspeed`

CONFIG = {
    "train_batch_size": 4,
    "train_micro_batch_size_per_gpu": 2,  # so 2 micro-batches per optimizer step
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3,
                                                       "warmup_num_steps": 2, "total_num_steps": 8}},
    "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
}


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int = 24, vocab: int = 256, seed: int = 1) -> None:
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_llama(seed: int = 0) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps")
    parser.add_argument("--checkpoint_dir", default=None)
    parser.add_argument("--report", default=None)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args(argv)

    model = tiny_llama()
    engine, optimizer, loader, lr_scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=RandomTokens(64),
        config=None if args.deepspeed_config else CONFIG)
    losses, lrs = [], []
    for batch in loader:
        batch = {k: v.to(engine.device) for k, v in batch.items()}
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        lrs.append(engine.get_lr()[0])
        if engine.global_steps == args.steps:
            break
    if args.checkpoint_dir:
        engine.save_checkpoint(args.checkpoint_dir, client_state={"args": args, "steps": engine.global_steps})
    report = {"losses": losses, "lrs": lrs, "global_steps": engine.global_steps}
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report, f)
    return report


if __name__ == "__main__":
    main()
