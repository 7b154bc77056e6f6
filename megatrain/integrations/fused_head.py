"""TRL's `fused_lm_head=True` forward, served from the logits the engine builds.

TRL's SFTTrainer patches the model's forward so that `model(..., labels=..., fused_lm_head=True)` returns
per-token log-probabilities, entropy and top-1 hits instead of logits (trl.trainer.utils.add_fused_lm_head).
Under MegaTrain the engine owns the forward, so the patch never runs; this computes the same fields from the
engine's logits (which already carry the model's own logit scaling / soft-capping). It materialises the
logits (`batch x seq x vocab` FP32 and as much again for their gradient), which TRL's tiled kernel avoids.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


def _output_class() -> Any:
    try:
        from trl.trainer.utils import FusedCausalLMOutput

        return FusedCausalLMOutput
    except ImportError:  # no TRL: the same fields on a plain ModelOutput
        from dataclasses import make_dataclass

        from transformers.utils import ModelOutput

        fields = ["loss", "log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask",
                  "aux_loss"]
        return make_dataclass("FusedCausalLMOutput", [(f, Any, None) for f in fields], bases=(ModelOutput,))


def fused_lm_head_forward(model: Callable[..., Any], input_ids: torch.Tensor | None, kwargs: dict[str, Any]) -> Any:
    """`model(input_ids, **kwargs, fused_lm_head=True)` with TRL's semantics, `model` being the engine-run model.

    Labels are shifted inside (or `shift_labels` taken as is); positions labelled -100 are zero in every
    field; the loss is `-sum(log_probs) / (valid tokens, or num_items_in_batch when given)`, as TRL computes it.
    """
    kwargs = dict(kwargs)
    labels = kwargs.pop("labels", None)
    shift_labels = kwargs.pop("shift_labels", None)
    num_items = kwargs.pop("num_items_in_batch", None)
    kwargs.pop("use_cache", None)
    if labels is None and shift_labels is None:
        raise ValueError("fused_lm_head=True needs labels (or shift_labels): it scores the next-token labels")
    logits = model(input_ids, return_logits=True, **kwargs).logits
    if shift_labels is None:
        logits, target = logits[:, :-1], labels[:, 1:]
    else:
        target = shift_labels
    target = target.to(logits.device)
    mask = target != -100
    logp = F.log_softmax(logits.float(), dim=-1)
    log_probs = logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1).masked_fill(~mask, 0.0)
    entropy = -(logp.exp() * logp).sum(-1).masked_fill(~mask, 0.0)
    is_top1 = (logits.argmax(-1) == target) & mask
    denom = mask.sum().clamp(min=1) if num_items is None else num_items
    loss = -log_probs.sum() / denom
    return _output_class()(loss=loss, log_probs=log_probs, entropy=entropy, is_top1=is_top1, label_mask=mask)


def serve_fused_lm_head(model: torch.nn.Module) -> None:
    """Let the engine-run `model` (after `Engine(model)` bound its forward) take TRL's `fused_lm_head=True`."""
    engine_forward = model.forward.__func__

    def forward(self: torch.nn.Module, *args: Any, fused_lm_head: bool = False, **kwargs: Any) -> Any:
        if not fused_lm_head:
            return engine_forward(self, *args, **kwargs)
        if len(args) > 1:
            raise TypeError("fused_lm_head=True: pass everything but input_ids by keyword")
        input_ids = args[0] if args else kwargs.pop("input_ids", None)
        return fused_lm_head_forward(types.MethodType(engine_forward, self), input_ids, kwargs)

    model.forward = types.MethodType(forward, model)
