"""TRL's `fused_lm_head=True` forward, served from the logits the engine builds.

TRL's trainers patch the model's forward (`trl.trainer.utils.add_fused_lm_head(model, temperature=...,
outputs=..., cast_lm_head_to_fp32=...)`) so that `model(..., labels=..., fused_lm_head=True)` returns per-token
log-probabilities and statistics instead of logits. Under MegaTrain the engine owns the forward and replaces
that patch, so the patch's options are read off it first (`trl_head_options`) and honoured here: GRPO scores its
samples at its sampling temperature, and a silently ignored temperature trains on wrong gradients. An option
this module does not know is refused by name rather than dropped.

The engine's logits already carry the model's own logit scaling and soft-capping (TRL re-derives the same
transform from the config), so the temperature divides them exactly where TRL's kernel does. This path
materialises the logits (`batch x seq x vocab` FP32 and as much again for their gradient), which TRL's tiled
kernel avoids.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

# Every per-token field TRL's fused head can return besides log_probs (trl.kernels.chunked_logprob).
OPTIONAL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
# The free variables of TRL's patched forward: what this module honours, and TRL's own plumbing. Logit scale and
# soft-capping are in the engine's logits already (the model's own forward applies them).
_HONOURED = {"temperature", "outputs", "cast_lm_head_to_fp32", "final_logit_softcapping", "logit_scale"}
_PLUMBING = {"original_forward", "text_config", "backbone_attr"}


@dataclass(frozen=True)
class FusedHeadOptions:
    """What TRL's `add_fused_lm_head` asked of the head; the defaults are a forward TRL did not patch."""

    temperature: float = 1.0
    outputs: tuple[str, ...] = ("log_probs", *OPTIONAL_OUTPUTS)
    cast_lm_head_to_fp32: bool = False


def trl_head_options(model: torch.nn.Module) -> FusedHeadOptions:
    """The options of TRL's fused-head patch on `model` (read before the engine replaces its forward).

    Raises if the patch holds an option this module would not honour, naming it.
    """
    bound = model.__dict__.get("forward")
    func = getattr(bound, "__func__", None)
    code = getattr(func, "__code__", None)
    if code is None or code.co_name != "_fused_forward" or "trl" not in code.co_filename.replace("\\", "/"):
        return FusedHeadOptions()
    found = dict(zip(code.co_freevars, (c.cell_contents for c in func.__closure__ or ())))
    unknown = sorted(set(found) - _HONOURED - _PLUMBING)
    if unknown:
        raise NotImplementedError(
            f"TRL's fused LM head on this model takes {unknown}, which MegaTrain's engine-served head does not "
            "implement; it would train with those options ignored. Use a TRL version whose add_fused_lm_head "
            f"takes only {sorted(_HONOURED)}, or train this trainer without MegaTrain")
    temperature = float(found.get("temperature", 1.0))
    if temperature <= 0:
        raise ValueError(f"TRL's fused LM head has temperature={temperature}; it must be positive")
    outputs = tuple(found.get("outputs", ("log_probs",)))
    bad = sorted(set(outputs) - {"log_probs", *OPTIONAL_OUTPUTS})
    if bad:
        raise NotImplementedError(f"TRL's fused LM head asks for outputs {bad}; MegaTrain serves "
                                  f"{['log_probs', *OPTIONAL_OUTPUTS]}")
    return FusedHeadOptions(temperature=temperature, outputs=outputs,
                            cast_lm_head_to_fp32=bool(found.get("cast_lm_head_to_fp32", False)))


def _output_class() -> Any:
    try:
        from trl.trainer.utils import FusedCausalLMOutput

        return FusedCausalLMOutput
    except ImportError:  # no TRL: the same fields on a plain ModelOutput
        from dataclasses import make_dataclass

        from transformers.utils import ModelOutput

        fields = ["loss", "log_probs", *OPTIONAL_OUTPUTS, "label_mask", "aux_loss"]
        return make_dataclass("FusedCausalLMOutput", [(f, Any, None) for f in fields], bases=(ModelOutput,))


def fused_lm_head_forward(model: Callable[..., Any], input_ids: torch.Tensor | None, kwargs: dict[str, Any],
                          options: FusedHeadOptions = FusedHeadOptions()) -> Any:
    """`model(input_ids, **kwargs, fused_lm_head=True)` with TRL's semantics, `model` being the engine-run model.

    Labels are shifted inside (or `shift_labels` taken as is); positions labelled -100 are zero in every
    field; the logits are divided by `options.temperature` before every field; the loss is
    `-sum(log_probs) / (valid tokens, or num_items_in_batch when given)`, as TRL computes it.
    """
    kwargs = dict(kwargs)
    labels = kwargs.pop("labels", None)
    shift_labels = kwargs.pop("shift_labels", None)
    num_items = kwargs.pop("num_items_in_batch", None)
    kwargs.pop("use_cache", None)
    if labels is None and shift_labels is None:
        raise ValueError("fused_lm_head=True needs labels (or shift_labels): it scores the next-token labels")
    logits = model(input_ids, return_logits=True, **kwargs).logits
    if options.cast_lm_head_to_fp32 and logits.dtype != torch.float32:
        raise NotImplementedError(
            f"TRL asked for the LM head in float32 (cast_lm_head_to_fp32=True) but the engine computes it in "
            f"{logits.dtype}; set the trainer's cast_lm_head_to_fp32=False, or compute_dtype 'float32' in the "
            "'megatrain' config section")
    if shift_labels is None:
        logits, target = logits[:, :-1], labels[:, 1:]
    else:
        target = shift_labels
    target = target.to(logits.device)
    mask = target != -100
    z = logits.float()
    if options.temperature != 1.0:
        z = z / options.temperature
    logp = F.log_softmax(z, dim=-1)
    log_probs = logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1).masked_fill(~mask, 0.0)
    fields: dict[str, torch.Tensor] = {}
    want = set(options.outputs)
    if "entropy" in want:
        fields["entropy"] = -(logp.exp() * logp).sum(-1).masked_fill(~mask, 0.0)
    with torch.no_grad():  # TRL marks these three non-differentiable
        if "log_sum_sq_probs" in want:
            fields["log_sum_sq_probs"] = torch.logsumexp(2 * logp, dim=-1).masked_fill(~mask, 0.0)
        if "mean_logits" in want:
            fields["mean_logits"] = z.mean(-1).masked_fill(~mask, 0.0)
        if "is_top1" in want:
            fields["is_top1"] = (z.argmax(-1) == target) & mask
    denom = mask.sum().clamp(min=1) if num_items is None else num_items
    loss = -log_probs.sum() / denom
    return _output_class()(loss=loss, log_probs=log_probs, label_mask=mask, **fields)


def serve_fused_lm_head(model: torch.nn.Module, options: FusedHeadOptions = FusedHeadOptions()) -> None:
    """Let the engine-run `model` (after `Engine(model)` bound its forward) take TRL's `fused_lm_head=True`,
    with the options `trl_head_options` read off TRL's patch before the engine replaced it."""
    engine_forward = model.forward.__func__

    def forward(self: torch.nn.Module, *args: Any, fused_lm_head: bool = False, **kwargs: Any) -> Any:
        if not fused_lm_head:
            return engine_forward(self, *args, **kwargs)
        if len(args) > 1:
            raise TypeError("fused_lm_head=True: pass everything but input_ids by keyword")
        input_ids = args[0] if args else kwargs.pop("input_ids", None)
        return fused_lm_head_forward(types.MethodType(engine_forward, self), input_ids, kwargs, options)

    model.forward = types.MethodType(forward, model)
