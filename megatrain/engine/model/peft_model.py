"""A PEFT model (`peft.get_peft_model(...)`, LoRA and the rest) given to the engine: the Hugging Face model it wraps
is what the engine takes, with PEFT's adapter modules inside its layers.

PEFT injects its adapters as submodules of the base model's own layers and freezes the base weights; its wrapper
(`PeftModel` -> `LoraModel` -> the HF model) forwards every call to that model. So the engine trains the inner
model as any partly frozen one (trainable.py: the base weights frozen, no slab or Adam state for them) and the
wrapper's own forward, `save_pretrained` and state dict reach the engine through the inner model object
(model_object.py). peft is never imported here: a model is recognised by its class's module.
"""

from __future__ import annotations

from torch import nn


def is_peft_model(model: nn.Module) -> bool:
    return type(model).__module__.split(".")[0] == "peft" and hasattr(model, "base_model")


def unwrap_peft(model: nn.Module) -> tuple[nn.Module, nn.Module | None]:
    """(the model the engine takes, the PEFT wrapper around it or None). A quantized base (QLoRA's 4-bit or 8-bit
    bitsandbytes weights) is refused by name: its weights are not the FP32/bf16 tensors the host store holds."""
    if not is_peft_model(model):
        return model, None
    inner = model.base_model
    while is_peft_model(inner) or type(inner).__module__.split(".")[0] == "peft":
        inner = inner.model  # PeftModel -> LoraModel (a tuner) -> the HF model
    quantized = [n for n, p in inner.named_parameters() if type(p).__module__.split(".")[0] == "bitsandbytes"]
    if getattr(inner, "is_loaded_in_4bit", False) or getattr(inner, "is_loaded_in_8bit", False) or quantized:
        raise ValueError(f"{type(model).__name__} over a quantized base model (QLoRA: bitsandbytes 4-bit/8-bit "
                         "weights): MegaTrain streams FP32 or bf16 weights from host memory and cannot train a "
                         "quantized base exactly; load the base in bf16 or FP32 (no quantization_config) for LoRA")
    return inner, model
