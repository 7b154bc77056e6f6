"""A PEFT model (`peft.get_peft_model(...)`, LoRA and the rest) given to the engine: the Hugging Face model it wraps
is what the engine takes, with PEFT's adapter modules inside its layers.

PEFT injects its adapters as submodules of the base model's own layers and freezes the base weights; its wrapper
(`PeftModel` -> `LoraModel` -> the HF model) forwards every call to that model. So the engine trains the inner
model as a partly frozen one (trainable.py: the base weights frozen, no slab or Adam state for them), with the
adapters inside its layers held as resident parameters (layer_adapters: their weights, gradients and Adam state on
the device; the layers' buffers the base alone), and the wrapper's own forward, `save_pretrained` and state dict
reach the engine through the inner model object (model_object.py). peft is never imported here: a model is
recognised by its class's module.
"""

from __future__ import annotations

from torch import nn

from .layer_adapters import attach_adapters

__all__ = ["attach_adapters", "is_peft_model", "layer_adapters", "unwrap_peft"]  # attach_adapters: the engine's hook


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


def _adapter_parts(module: nn.Module) -> tuple[str, ...]:
    """The submodule names under which one of PEFT's tuner layers keeps its adapters' weights (its
    `adapter_layer_names`: LoRA's lora_A/lora_B/lora_embedding_A/B/lora_magnitude_vector, ModulesToSaveWrapper's
    modules_to_save, the other tuners' own); () for any other module."""
    if type(module).__module__.split(".")[0] != "peft":
        return ()
    names = getattr(module, "adapter_layer_names", ())
    return tuple(n for n in names if isinstance(n, str))


def layer_adapters(layers: nn.ModuleList, prefix: str) -> set[str]:
    """The full names of the adapters' parameters inside the decoder layers: held resident on the device beside the
    embedding and head (their weights, gradients and Adam state; they are small), so each layer's streamed buffer
    is its base weights alone (wholly frozen under LoRA: held as loaded, no slab, no host update). A
    `modules_to_save` copy is resident where it is a vector (a norm's weight, a bias); a copy of a weight matrix is
    as large as the base weight it copies and streams with its layer."""
    found: set[str] = set()
    for i, layer in enumerate(layers):
        for mname, mod in layer.named_modules():
            for part in _adapter_parts(mod):
                sub = getattr(mod, part, None)
                if not isinstance(sub, nn.Module):
                    continue
                saved_copy = part == "modules_to_save"
                for pname, p in sub.named_parameters():
                    if saved_copy and p.dim() > 1:
                        continue
                    found.add(".".join(x for x in (prefix, str(i), mname, part, pname) if x))
    return found
