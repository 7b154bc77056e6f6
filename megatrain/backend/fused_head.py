"""TRL's `fused_lm_head=True` forward, served from the logits the engine builds.

TRL's trainers patch the model's forward (`trl.trainer.utils.add_fused_lm_head(model, temperature=...,
outputs=..., cast_lm_head_to_fp32=...)`) so that `model(..., labels=..., fused_lm_head=True)` returns per-token
log-probabilities and statistics instead of logits. Under MegaTrain the engine owns the forward and replaces
that patch, so the patch's options are read off it first (`trl_head_options`) and honoured here: GRPO scores its
samples at its sampling temperature, and a silently ignored temperature trains on wrong gradients. An option
this module does not know is refused by name rather than dropped.

The engine returns the LM head's input and TRL's own tiled kernel does the scoring, so this head holds what
TRL's does on a plain model: one `tokens x vocab-tile` workspace, never the `batch x seq x vocab` logits (the
engine refuses models whose wrapper scales its logits, so the only transform left is the soft-capping).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# Every per-token field TRL's fused head can return besides log_probs (trl.kernels.chunked_logprob), in its order.
OPTIONAL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
# The free variables of TRL's patched forward: what this module honours, and TRL's own plumbing. Logit scale and
# soft-capping are in the engine's logits already (the model's own forward applies them).
_HONOURED = {"temperature", "outputs", "cast_lm_head_to_fp32", "final_logit_softcapping", "logit_scale"}
_PLUMBING = {"original_forward", "text_config", "backbone_attr"}
# The kernel's vocabulary tile (TRL's own choice for its fused head): tokens x this many logits at a time.
_VOCAB_TILE = 32768


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
                          options: FusedHeadOptions = FusedHeadOptions(),
                          head: torch.nn.Linear | None = None,
                          chunk_tokens: int | Callable[[], int] | None = None) -> Any:
    """`model(input_ids, **kwargs, fused_lm_head=True)` with TRL's semantics, `model` being the engine-run model.

    The engine hands back the LM head's input (its final norm applied, `return_hidden=True`) and TRL's own
    chunked kernel (`trl.kernels.chunked_logprob`) scores the labelled positions through `head` (the model's
    output embedding by default) in vocabulary tiles, `chunk_tokens` positions at a time, forward and backward:
    the `tokens x vocab` logits never exist. Labels are shifted inside (or `shift_labels` taken as is); positions labelled -100 are zero in every
    field; the logits are divided by `options.temperature` (after the model's soft-capping) before every field;
    the loss is `-sum(log_probs) / (valid tokens, or num_items_in_batch when given)`, as TRL computes it.
    """
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    kwargs = dict(kwargs)
    labels = kwargs.pop("labels", None)
    shift_labels = kwargs.pop("shift_labels", None)
    num_items = kwargs.pop("num_items_in_batch", None)
    kwargs.pop("use_cache", None)
    if labels is None and shift_labels is None:
        raise ValueError("fused_lm_head=True needs labels (or shift_labels): it scores the next-token labels")
    out = model(input_ids, return_hidden=True, return_logits=False, **kwargs)
    hidden = out.hidden_states[-1]
    head = head if head is not None else model.__self__.get_output_embeddings()
    if options.cast_lm_head_to_fp32 and head.weight.dtype != torch.float32:
        raise NotImplementedError(
            f"TRL asked for the LM head in float32 (cast_lm_head_to_fp32=True) but the engine computes it in "
            f"{head.weight.dtype}; set the trainer's cast_lm_head_to_fp32=False, or compute_dtype 'float32' in "
            "the 'megatrain' config section")
    if shift_labels is None:
        hidden, target = hidden[:, :-1], labels[:, 1:]
    else:
        target = shift_labels
    target = target.to(hidden.device)
    mask = target != -100
    # Only the labelled positions go through the head: padding and prompts cost no head FLOPs. The kernel tiles
    # the vocabulary but takes up to 4096 tokens a tile; the engine's own head chunk bounds the tokens instead.
    h, t = hidden[mask], target[mask]
    tile = min(head.weight.shape[0], _VOCAB_TILE)
    chunk = max(1, (chunk_tokens() if callable(chunk_tokens) else chunk_tokens) or h.shape[0])
    softcap, outputs = _softcap(model), tuple(options.outputs)
    parts = [ChunkedLogProbFunction.apply(h[s: s + chunk], head.weight, head.bias, t[s: s + chunk],
                                          options.temperature, tile, softcap, 1.0, outputs)
             for s in range(0, max(h.shape[0], 1), chunk)]
    fields = [None if parts[0][i] is None else torch.cat([p[i] for p in parts]) for i in range(len(parts[0]))]
    # masked_scatter keeps an all-masked micro-batch connected to the model (a differentiable zero), as in TRL.
    log_probs, *rest = (None if x is None else x.new_zeros(mask.shape).masked_scatter(mask, x) for x in fields)
    denom = mask.sum().clamp(min=1) if num_items is None else num_items
    loss = -log_probs.sum() / denom
    aux = getattr(out, "aux_loss", None)
    if out.loss is not None:  # a mixture of experts: the router term the model's forward adds, as TRL adds it
        loss = loss + out.loss
    extra = {name: value for name, value in zip(OPTIONAL_OUTPUTS, rest) if name in options.outputs}
    return _output_class()(loss=loss, log_probs=log_probs, label_mask=mask, aux_loss=aux, **extra)


def _softcap(model: Callable[..., Any]) -> float | None:
    config = getattr(getattr(model, "__self__", None), "config", None)
    cap = getattr(config.get_text_config(), "final_logit_softcapping", None) if config is not None else None
    return float(cap) if cap else None


def serve_fused_lm_head(model: torch.nn.Module, options: FusedHeadOptions = FusedHeadOptions(),
                        chunk_tokens: Callable[[], int] | None = None) -> None:
    """Let the engine-run `model` (after `Engine(model)` bound it) take TRL's `fused_lm_head=True`, with the
    options `trl_head_options` read off TRL's patch before the engine took the model; `chunk_tokens` gives the
    engine's head chunk for the batch just run (`Engine.head_chunk_tokens`). Served through the binding
    (`serve_forward_keyword`): the forward stays the model class's, nothing is set on the instance."""
    from ..engine import serve_forward_keyword

    def serve(routed: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if len(args) > 1:
            raise TypeError("fused_lm_head=True: pass everything but input_ids by keyword")
        input_ids = args[0] if args else kwargs.pop("input_ids", None)
        return fused_lm_head_forward(routed, input_ids, kwargs, options, chunk_tokens=chunk_tokens)

    serve_forward_keyword(model, "fused_lm_head", serve)
