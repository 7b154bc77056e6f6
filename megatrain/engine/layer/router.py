"""Mixture-of-experts routers: their logits recorded per layer, and the model's own router loss over them.

A mixture-of-experts causal LM adds `router_aux_loss_coef * aux_loss(router logits of every layer)` (and in some
families a z-loss) to its loss when `output_router_logits` is on. That term couples all layers, while the engine
differentiates one layer at a time. So the engine records each layer's router logits during its forward (they are
tokens x experts: small), computes the term after the forward on detached leaves of them, and feeds the gradient
autograd gives each leaf into that layer's recomputed backward as a second output gradient.

The term is not re-implemented here: the model's own *ForCausalLM forward computes it, with its decoder stack
swapped for a stand-in that hands back the recorded logits and its token loss swapped for zero, so whatever the
family adds to its loss (its aux-loss variant, attention-mask weighting, coefficients, z-losses) is the model's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import MoeModelOutputWithPast

from ...models.adapter import DecoderParts

ROUTER_KEY = "router_logits"


def router_recorder(base: nn.Module) -> Any | None:
    """The model's own recipe for where its router logits come from (`_can_record_outputs["router_logits"]`:
    an OutputRecorder, or a bare module class), or None for a model without routers."""
    spec = (getattr(base, "_can_record_outputs", None) or {}).get(ROUTER_KEY)
    return spec


def _recorder_fields(spec: Any) -> tuple[type | None, int, str | None, str | None]:
    if isinstance(spec, type):
        return spec, 0, None, None
    return (getattr(spec, "target_class", None), getattr(spec, "index", 0), getattr(spec, "layer_name", None),
            getattr(spec, "class_name", None))


def router_modules(layer: nn.Module, spec: Any) -> list[tuple[nn.Module, int]]:
    """The modules of `layer` whose output HF records as router logits, with the output index it records,
    matched as transformers' own hook installer matches them (class, class-name suffix, layer name)."""
    target, index, layer_name, class_name = _recorder_fields(spec)
    found = []
    for name, mod in layer.named_modules():
        full = f".{name}" if name else ""
        hit = (target is not None and isinstance(mod, target)) or (class_name is not None and full.endswith(class_name))
        if hit and layer_name is not None:
            hit = f".{layer_name.strip('.')}." in full + "."
        if hit:
            found.append((mod, index))
    return found


def wants_router_loss(parts: DecoderParts, output_router_logits: bool | None) -> bool:
    """Whether the model's loss includes its router term: the call's `output_router_logits`, else the config's,
    as the *ForCausalLM forward decides it."""
    if router_recorder(parts.base) is None:
        return False
    on = output_router_logits if output_router_logits is not None else getattr(parts.model.config,
                                                                                "output_router_logits", False)
    return bool(on)


class _RecordedStack(nn.Module):
    """Stands in for the decoder stack in the model's own forward: returns the recorded router logits."""

    def __init__(self, hidden: torch.Tensor, router_logits: tuple[torch.Tensor, ...]) -> None:
        super().__init__()
        self.hidden = hidden
        self.router_logits = router_logits

    def forward(self, *args: Any, **kwargs: Any) -> MoeModelOutputWithPast:
        return MoeModelOutputWithPast(last_hidden_state=self.hidden, router_logits=self.router_logits)


def _zero_token_loss(logits: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.zeros((), dtype=torch.float32, device=logits.device)


def model_router_loss(parts: DecoderParts, router_logits: list[torch.Tensor], input_ids: torch.Tensor,
                      attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
                      labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(what the model's forward adds to its token loss, its `aux_loss` output) for these router logits.

    Autograd reaches the logits through both: pass leaves, and their gradients are what each layer's router
    logits must be backpropagated with.
    """
    model = parts.model
    owner_name, _, attr = parts.base_prefix.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    head = parts.lm_head.weight
    hidden = torch.zeros(input_ids.shape[0], 1, head.shape[1], dtype=head.dtype, device=head.device)
    had_loss_fn = "_loss_function" in vars(model)
    saved_loss_fn = vars(model).get("_loss_function")
    setattr(owner, attr, _RecordedStack(hidden, tuple(router_logits)))
    model.loss_function = _zero_token_loss
    try:
        # The class forward; on a bound model that is the engine's route, which hands a model whose stack is a
        # _RecordedStack back to the model's own forward (model_object.py).
        out = type(model).forward(model, input_ids=input_ids, attention_mask=attention_mask,
                                  position_ids=position_ids, labels=labels, output_router_logits=True,
                                  use_cache=False, logits_to_keep=1)
    finally:
        setattr(owner, attr, parts.base)
        if had_loss_fn:
            model.loss_function = saved_loss_fn
        else:
            del model._loss_function
    return out.loss, getattr(out, "aux_loss", None)
