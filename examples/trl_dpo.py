"""TRL's DPOTrainer on MegaTrain: the upstream DPO recipe plus two lines (marked "MegaTrain").

    megatrain launch examples/trl_dpo.py --output_dir out                # MegaTrain (the config's "megatrain" section)
    python examples/trl_dpo.py --output_dir out                          # the same, the script's own import routing
    python examples/trl_dpo.py --output_dir out --backend torch          # the same script on plain DPOTrainer

The reference model is the policy before training, its log-probabilities computed once before the first step
(`precompute_ref_log_probs=True`, a DPOConfig option) through the same engine: no second copy of the model is
held. A tiny randomly initialised Llama, a word-level tokenizer and preference pairs built in memory keep it
self-contained; swap in your model, tokenizer and dataset. `--report FILE` writes the per-step losses, gradient
norms and reward margins, and which engine trained, as JSON.
"""

from __future__ import annotations

import argparse
import json
import random

from datasets import Dataset
from trl import DPOConfig, DPOTrainer
from trl_sft import WORDS, ds_config, tiny_llama, tiny_tokenizer


def pairs(n: int, seed: int) -> Dataset:
    """Prompts with a preferred completion of even-numbered words and a rejected one of odd-numbered words (each
    completion starts with a space: TRL joins prompt and completion as they are)."""
    rng = random.Random(seed)
    even, odd = WORDS[0::2], WORDS[1::2]
    return Dataset.from_dict({
        "prompt": [" ".join(rng.choices(WORDS, k=rng.randint(3, 6))) for _ in range(n)],
        "chosen": [" " + " ".join(rng.choices(even, k=rng.randint(2, 5))) for _ in range(n)],
        "rejected": [" " + " ".join(rng.choices(odd, k=rng.randint(2, 5))) for _ in range(n)]})


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--output_dir", required=True)
    p.add_argument("--backend", choices=["megatrain", "torch"], default="megatrain")
    p.add_argument("--max_steps", type=int, default=3)
    p.add_argument("--report", default=None)
    a = p.parse_args(argv)
    if a.backend == "megatrain":
        import megatrain.integrations.hf  # noqa: F401  MegaTrain: Trainer's DeepSpeed path now runs MegaTrain

    tokenizer = tiny_tokenizer()
    args = DPOConfig(
        output_dir=a.output_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=a.max_steps,
        learning_rate=1e-3, max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[], seed=0,
        use_cpu=True, max_length=32, precompute_ref_log_probs=True,
        bf16=False,  # FP32, so the two backends can be compared to 1e-5 (TRL defaults to bf16)
        deepspeed=ds_config() if a.backend == "megatrain" else None)
    trainer = DPOTrainer(model=tiny_llama(len(tokenizer)), args=args, processing_class=tokenizer,
                         train_dataset=pairs(32, seed=1))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    out = {"losses": {h["step"]: h["loss"] for h in logs}, "grad_norms": {h["step"]: h["grad_norm"] for h in logs},
           "margins": {h["step"]: h["rewards/margins"] for h in logs},
           "engine": type(trainer.model_wrapped).__name__}
    if a.report:
        with open(a.report, "w") as f:
            json.dump(out, f)
    return out


if __name__ == "__main__":
    main()
