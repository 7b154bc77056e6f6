"""The cases of a partly frozen model the frozen-parameter tests share (tests/unit/test_frozen.py, the torchrun worker
tests/workers/frozen_dp_worker.py and tests/integration/test_frozen_faces.py)."""

from __future__ import annotations

import torch
from conftest import make_batches, tiny_model

STEPS, LR, CLIP = 5, 1e-3, 1.0
BATCHES = make_batches(STEPS)
BATCHES_DP = make_batches(2 * STEPS, seed=2)  # two ranks: step s takes 2s on rank 0, 2s + 1 on rank 1

# What each case freezes: a predicate on the parameter's HF name.
CASES = {
    "embedding": lambda n: n.startswith("model.embed_tokens"),
    "layer0": lambda n: n.startswith("model.layers.0."),
    "layer1_attention": lambda n: n.startswith("model.layers.1.self_attn."),
}


def frozen_model(case: str, **kw) -> torch.nn.Module:
    m = tiny_model("llama", **kw)
    for n, p in m.named_parameters():
        if CASES[case](n):
            p.requires_grad_(False)
    return m


def ds_config(**over) -> dict:
    """A DeepSpeed config of the reference's training: AdamW lr 1e-3 (torch's default weight decay), clipping 1.0,
    FP32 compute."""
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": CLIP,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
           "megatrain": {"compute_dtype": "float32", "optimizer_overlap": False}}
    cfg.update(over)
    return cfg


def top_layers_model(layers: int = 8, trainable: int = 2, **kw) -> torch.nn.Module:
    """A tiny Llama whose top `trainable` of `layers` layers train, with the final norm and head; the embedding and
    the layers below frozen (layer-wise fine-tuning)."""
    m = tiny_model("llama", layers=layers, **kw)
    low = layers - trainable
    for n, p in m.named_parameters():
        if n.startswith("model.embed_tokens") or any(n.startswith(f"model.layers.{i}.") for i in range(low)):
            p.requires_grad_(False)
    return m


def has_peft() -> bool:
    import importlib.util

    return importlib.util.find_spec("peft") is not None


def build(case: str) -> torch.nn.Module:
    """A case of CASES, or "lora": a PEFT LoRA model (r 8 on q/v) over the same tiny Llama."""
    if case != "lora":
        return frozen_model(case)
    import warnings

    import peft

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                                         target_modules=["q_proj", "v_proj"]))


def dp_cases() -> list[str]:
    """The cases the two-rank run trains: CASES, and LoRA where peft is installed."""
    return [*CASES, *(["lora"] if has_peft() else [])]
