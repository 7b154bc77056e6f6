"""The parity probe for a decoder under a head of its own: sequence classification, reward and value heads
(`DecoderParts.head_name`, models/adapter.py).

What the engine serves for such a model is its decoder base's forward: the last hidden state (final norm applied)
and, through `engine.backward`, its gradient; the head, the pooling and the loss are the model's own code and run as
they are (model_object.py `_route_base`). So the probe proves the base under a head, each on its own terms:

- a transformers class (`LlamaForSequenceClassification`, ...) is built small from the user's config and trained as
  itself: its own pooling at each row's last non-pad token and its own loss (regression for `num_labels=1`, a reward
  model's, else classification as its `problem_type` says), on batches with a right-padded row and sequence labels;
- a user's wrapper (DeepSpeed-Chat's RewardModel: `.config`, a base model, a `v_head`), whose class is not built from
  a config, is probed as `scorer_class(type(base))`: the base's class under a linear head, pooled at each row's last
  attended token, trained on the pairwise reward loss `-logsigmoid(r_chosen - r_rejected)` (rows 0 and 1).

Both have their own verdicts in the probe's cache: the class probed differs from the causal LM's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...models.adapter import find_other_head


@dataclass(frozen=True)
class HeadSubject:
    """What the probe builds for a model with a head of its own: `model_cls(config)` and its name in a verdict."""

    model_cls: type
    architecture: str
    labelled: bool  # the model's loss takes a label per row (a transformers class); else the pairwise loss, none


def head_subject(model: nn.Module) -> HeadSubject | None:
    """The probe's subject for `model` when its head is not a causal LM's (None: a causal LM, probed as itself)."""
    found = find_other_head(model)
    if found is None:
        return None
    base = model.get_submodule(found[0])
    cls = type(model)
    from transformers import PreTrainedModel

    if issubclass(cls, PreTrainedModel) and cls.__module__.startswith("transformers."):
        return HeadSubject(cls, cls.__name__, True)
    plain = getattr(type(base), "_megatrain_plain_class", type(base))
    return HeadSubject(scorer_class(plain), f"{plain.__name__} under {cls.__name__}'s head `{found[1]}`", False)


@functools.cache
def scorer_class(base_cls: type) -> type:
    """A reward model over `base_cls` built from a config, as DeepSpeed-Chat's RewardModel is over a base model: a
    linear `v_head` on the last hidden state, each row's reward at its last attended token, the pairwise loss of
    row 2i (chosen) over row 2i + 1 (rejected)."""

    def __init__(self: nn.Module, config: Any) -> None:
        nn.Module.__init__(self)
        self.base = base_cls(config)
        self.config = self.base.config  # one config object: the engine switches its attention implementation
        self.v_head = nn.Linear(self.config.hidden_size, 1, bias=False)

    def forward(self: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                **_: Any) -> Any:
        from transformers.modeling_outputs import SequenceClassifierOutput

        hidden = self.base(input_ids, attention_mask=attention_mask, use_cache=False)[0]
        rewards = self.v_head(hidden).squeeze(-1).float()
        mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        last = (torch.arange(mask.shape[-1], device=mask.device) * mask).argmax(-1)
        end = rewards[torch.arange(rewards.shape[0], device=rewards.device), last]
        loss = -F.logsigmoid(end[0::2] - end[1::2]).mean()
        return SequenceClassifierOutput(loss=loss, logits=end)

    return type(f"Scorer_{base_cls.__name__}", (nn.Module,), {
        "__init__": __init__, "forward": forward, "__module__": __name__,
        "__doc__": f"{base_cls.__name__} under a scalar reward head (the parity probe's, probe_heads.py)"})


def prepare_config(config: Any) -> Any:
    """The probe's small config, as a head needs it: a padding id (transformers' pooling refuses batches of more than
    one row without one; the probe's batches pad with it)."""
    if getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = 0
    return config


def head_batches(config: Any, labelled: bool, n: int, vocab: int, seq: int, seed: int = 1234,
                 pad: bool = True) -> list[dict[str, torch.Tensor]]:
    """Two rows per batch, the second right-padded with the padding id over its last quarter (so pooling at the last
    non-pad token is not the last position), labels of one per row as the model's loss takes them."""
    g = torch.Generator().manual_seed(seed)
    pad_id = int(config.pad_token_id)
    out = []
    for _ in range(n):
        ids = torch.randint(3, vocab, (2, seq), generator=g)
        mask = torch.ones_like(ids)
        if pad:
            mask[1, seq - seq // 4:] = 0
            ids[1, seq - seq // 4:] = pad_id
        batch = {"input_ids": ids, "attention_mask": mask}
        if labelled:
            batch["labels"] = _labels(config, g)
        out.append(batch)
    return out


def _labels(config: Any, g: torch.Generator) -> torch.Tensor:
    k, kind = int(config.num_labels), getattr(config, "problem_type", None)
    if kind == "regression" or (kind is None and k == 1):
        return torch.randn(2, k, generator=g).squeeze(-1)
    if kind == "multi_label_classification":
        return torch.randint(0, 2, (2, k), generator=g).float()
    return torch.randint(0, k, (2,), generator=g)
