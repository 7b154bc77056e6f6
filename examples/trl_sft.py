"""TRL's SFTTrainer on MegaTrain: the upstream SFT recipe plus two lines (marked "MegaTrain").

    python examples/trl_sft.py --output_dir out                   # MegaTrain (the config's "megatrain" section)
    python examples/trl_sft.py --output_dir out --backend torch   # the same script on plain SFTTrainer

A tiny randomly initialised Llama and a word-level tokenizer built in memory keep it self-contained; swap in
your model, tokenizer and dataset. `--report FILE` writes the per-step losses, the evaluation loss and
which engine trained, as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random

import torch
import transformers
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from trl import SFTConfig, SFTTrainer

WORDS = [f"w{i}" for i in range(200)]


def tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                                unk_token="<unk>")


def tiny_llama(vocab: int, seed: int = 0) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=128,
                                   pad_token_id=0, eos_token_id=1)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def texts(n: int, seed: int) -> Dataset:
    rng = random.Random(seed)
    return Dataset.from_dict({"text": [" ".join(rng.choices(WORDS, k=rng.randint(8, 20))) for _ in range(n)]})


def ds_config() -> dict:
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

    tokenizer = tiny_tokenizer()
    args = SFTConfig(
        output_dir=a.output_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=a.max_steps,
        learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=2, max_grad_norm=1.0, weight_decay=0.01,
        logging_steps=1, save_steps=a.save_steps, report_to=[], seed=0, use_cpu=True, max_length=32,
        bf16=False,  # FP32, so the two backends can be compared to 1e-5 (TRL defaults to bf16)
        deepspeed=ds_config() if a.backend == "megatrain" else None)
    trainer = SFTTrainer(model=tiny_llama(len(tokenizer)), args=args, processing_class=tokenizer,
                         train_dataset=texts(64, seed=1), eval_dataset=texts(8, seed=2))
    trainer.train(resume_from_checkpoint=a.resume_from_checkpoint)
    metrics = trainer.evaluate()
    trainer.save_model(os.path.join(a.output_dir, "final"))
    out = {"losses": {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h},
           "eval_loss": metrics["eval_loss"], "engine": type(trainer.model_wrapped).__name__,
           "engine_global_steps": getattr(trainer.model_wrapped, "global_steps", None),
           "token_accuracy": {h["step"]: h["mean_token_accuracy"] for h in trainer.state.log_history
                              if "mean_token_accuracy" in h}}
    if a.report:
        with open(a.report, "w") as f:
            json.dump(out, f)
    return out


if __name__ == "__main__":
    main()
