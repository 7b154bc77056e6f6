"""Hugging Face Trainer on MegaTrain: the upstream Trainer recipe plus two lines (marked "MegaTrain").

    python examples/hf_trainer.py --output_dir out             # MegaTrain (the config's "megatrain" section)
    python examples/hf_trainer.py --output_dir out --backend torch   # the same script on plain Trainer

A tiny randomly initialised Llama on random tokens keeps it self-contained; swap in your model and data.
`--report FILE` writes the per-step losses, the evaluation loss and which engine trained, as JSON.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import transformers


def tiny_llama(seed: int = 0) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    return transformers.AutoModelForCausalLM.from_config(cfg)


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int = 24, vocab: int = 256, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.ids[i]}


def ds_config() -> dict:
    # "auto" values are filled from TrainingArguments by transformers, as for any DeepSpeed run.
    return {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
            "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                  "offload_optimizer": {"device": "cpu"}},
            "megatrain": {}}  # MegaTrain: this section selects it


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--output_dir", required=True)
    p.add_argument("--backend", choices=["megatrain", "torch"], default="megatrain")
    p.add_argument("--max_steps", type=int, default=8)
    p.add_argument("--save_steps", type=int, default=4)
    p.add_argument("--resume_from_checkpoint", default=None)
    p.add_argument("--report", default=None)
    a = p.parse_args(argv)
    if a.backend == "megatrain":
        import megatrain.integrations.hf  # noqa: F401  MegaTrain: Trainer's DeepSpeed path now runs MegaTrain

    args = transformers.TrainingArguments(
        output_dir=a.output_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=a.max_steps,
        learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=2, max_grad_norm=1.0, weight_decay=0.01,
        logging_steps=1, save_steps=a.save_steps, eval_strategy="no", report_to=[], seed=0, use_cpu=True,
        deepspeed=ds_config() if a.backend == "megatrain" else None)
    trainer = transformers.Trainer(model=tiny_llama(), args=args, train_dataset=RandomTokens(64),
                                   eval_dataset=RandomTokens(8, seed=2))
    trainer.train(resume_from_checkpoint=a.resume_from_checkpoint)
    metrics = trainer.evaluate()
    trainer.save_model(os.path.join(a.output_dir, "final"))
    out = {"losses": {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h},
           "eval_loss": metrics["eval_loss"], "engine": type(trainer.model_wrapped).__name__,
           "engine_global_steps": getattr(trainer.model_wrapped, "global_steps", None)}
    if a.report:
        with open(a.report, "w") as f:
            json.dump(out, f)
    return out


if __name__ == "__main__":
    main()
