"""TRL's RewardTrainer on AutoModelForSequenceClassification (num_labels=1), twice in one process
(tests/unit/test_reward_heads.py): on plain PyTorch, then on MegaTrain (a "megatrain" section in the DeepSpeed config
given to RewardConfig). A tiny preference dataset is made here; FP32, clipping 1.0, AdamW.

    reward_trainer_runs.py OUT    writes OUT/plain.json and OUT/megatrain.json: per-step losses, gradient norms and
                                  reward accuracies, which engine trained, and the trained score head's weights
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import torch  # noqa: E402
import transformers  # noqa: E402
from datasets import Dataset  # noqa: E402
from trl_sft import WORDS, ds_config, tiny_tokenizer  # noqa: E402  (from examples/, put on the path above)


def preferences(n: int, seed: int) -> Dataset:
    """Pairs whose chosen text holds more even-numbered words than the rejected one, of different lengths (the
    collator right-pads them, so each row's reward is read at its own last token)."""
    rng = random.Random(seed)
    evens, odds = WORDS[0::2], WORDS[1::2]
    rows = {"chosen": [], "rejected": []}
    for _ in range(n):
        rows["chosen"].append(" ".join(rng.choices(evens, k=rng.randint(4, 12))))
        rows["rejected"].append(" ".join(rng.choices(odds, k=rng.randint(4, 12))))
    return Dataset.from_dict(rows)


def reward_model(vocab: int) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=128,
                                   pad_token_id=0, eos_token_id=1, num_labels=1)
    return transformers.AutoModelForSequenceClassification.from_config(cfg)


def run(out: Path, name: str, megatrain: bool) -> None:
    from trl import RewardConfig, RewardTrainer

    tokenizer = tiny_tokenizer()
    args = RewardConfig(
        output_dir=str(out / name), per_device_train_batch_size=4, gradient_accumulation_steps=1, max_steps=6,
        learning_rate=3e-3, max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[], seed=0,
        use_cpu=True, bf16=False, deepspeed=ds_config() if megatrain else None)
    trainer = RewardTrainer(model=reward_model(len(tokenizer)), args=args, processing_class=tokenizer,
                            train_dataset=preferences(24, seed=1))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    score = trainer.model.state_dict()["score.weight"]
    report = {"losses": {h["step"]: h["loss"] for h in logs}, "grad_norms": {h["step"]: h["grad_norm"] for h in logs},
              "accuracy": {h["step"]: h["accuracy"] for h in logs}, "engine": type(trainer.model_wrapped).__name__,
              "score": score.float().flatten().tolist()}
    (out / f"{name}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    where = Path(sys.argv[1])
    run(where, "plain", megatrain=False)
    import megatrain.integrations.hf  # noqa: F401  Trainer's DeepSpeed path runs MegaTrain from here on
    run(where, "megatrain", megatrain=True)
