"""TRL's GRPOTrainer on MegaTrain, sampling at temperature 0.7: the upstream GRPO recipe plus two lines
(marked "MegaTrain").

    python examples/trl_grpo.py --output_dir out                   # MegaTrain (the config's "megatrain" section)
    python examples/trl_grpo.py --output_dir out --backend torch   # the same script on plain GRPOTrainer

GRPO scores its samples with log-probabilities at its sampling temperature (TRL's fused LM head); MegaTrain
honours that temperature. A tiny randomly initialised Llama, a word-level tokenizer and a reward that counts
even-numbered words keep it self-contained; swap in your model, tokenizer, prompts and reward. `--report FILE` writes the
per-step losses, gradient norms and rewards, and which engine trained, as JSON.
"""

from __future__ import annotations

import argparse
import json
import random

from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer
from trl_sft import WORDS, ds_config, tiny_llama, tiny_tokenizer


def prompts(n: int, seed: int) -> Dataset:
    rng = random.Random(seed)
    return Dataset.from_dict({"prompt": [" ".join(rng.choices(WORDS, k=6)) for _ in range(n)]})


def reward_even(completions: list[str], **_: object) -> list[float]:
    """A toy reward: the share of the completion's words with an even number ("w4", "w10", ...)."""
    return [sum(w[1:].isdigit() and int(w[1:]) % 2 == 0 for w in c.split()) / max(len(c.split()), 1)
            for c in completions]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--output_dir", required=True)
    p.add_argument("--backend", choices=["megatrain", "torch"], default="megatrain")
    p.add_argument("--max_steps", type=int, default=3)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--report", default=None)
    a = p.parse_args(argv)
    if a.backend == "megatrain":
        import megatrain.integrations.hf  # noqa: F401  MegaTrain: Trainer's DeepSpeed path now runs MegaTrain

    tokenizer = tiny_tokenizer()
    args = GRPOConfig(
        output_dir=a.output_dir, per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=2,
        max_completion_length=8, temperature=a.temperature, max_steps=a.max_steps, learning_rate=1e-3,
        max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[], seed=0, use_cpu=True,
        bf16=False,  # FP32, so the two backends can be compared to 1e-5
        deepspeed=ds_config() if a.backend == "megatrain" else None)
    trainer = GRPOTrainer(model=tiny_llama(len(tokenizer)), reward_funcs=reward_even, args=args,
                          processing_class=tokenizer, train_dataset=prompts(32, seed=1))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    out = {"losses": {h["step"]: h["loss"] for h in logs}, "grad_norms": {h["step"]: h["grad_norm"] for h in logs},
           "rewards": {h["step"]: h["reward"] for h in logs}, "engine": type(trainer.model_wrapped).__name__}
    if a.report:
        with open(a.report, "w") as f:
            json.dump(out, f)
    return out


if __name__ == "__main__":
    main()
