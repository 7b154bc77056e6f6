"""The cases of a partly frozen model the frozen-parameter tests share (tests/unit/test_frozen.py, the torchrun worker
tests/workers/frozen_dp_worker.py and tests/integration/test_frozen_faces.py)."""

from __future__ import annotations

import copy
from collections.abc import Callable

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


def reference(model: torch.nn.Module, batches=BATCHES, steps: int = STEPS, clip: float = CLIP,
              given: Callable[[str], bool] | None = None) -> tuple[list[float], list[float], torch.nn.Module]:
    """(losses, pre-clip norms, the trained copy) of plain PyTorch (plain PEFT for a PeftModel) training a copy of
    `model` with DeepSpeed's rule: AdamW over the trainable parameters, clip_grad_norm_ over them (`given`: over the
    parameters whose name it takes instead, as model_parameters hands them)."""
    model = copy.deepcopy(model)
    params = [p for n, p in model.named_parameters() if (given(n) if given is not None else p.requires_grad)]
    opt = torch.optim.AdamW(params, lr=LR)
    losses, norms = [], []
    for b in batches[:steps]:
        loss = model(**b).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, model


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


def lora_model(**config) -> torch.nn.Module:
    """A PEFT LoRA model (r 8 on q/v, alpha 16, no dropout; `config`: more of LoraConfig's fields) over a tiny Llama."""
    import warnings

    import peft

    cfg = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], **config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(tiny_model("llama"), cfg)


def build(case: str) -> torch.nn.Module:
    """A case of CASES, or "lora": a PEFT LoRA model (r 8 on q/v) over the same tiny Llama."""
    return lora_model() if case == "lora" else frozen_model(case)


def dp_cases() -> list[str]:
    """The cases the two-rank run trains: CASES, and LoRA where peft is installed."""
    return [*CASES, *(["lora"] if has_peft() else [])]
