"""A dense decoder-only model's shape read off the model itself: transformers builds it from its config on the
meta device (no memory, no weights), the engine's own adapter (models/adapter.py: find_parts) finds its decoder
layers, embedding, head and final norm exactly as training will, refusing what the engine refuses, and the planner
takes each layer's parameter count and the attention and MLP widths from the modules, whatever the model_type
(Llama, Qwen3, Gemma, OLMo, GPT-2, ...).

The counts are the model's own, so host memory, streaming and the optimizer are planned from what the engine will
store; the compute side (FLOPs, activations) uses the widths read here through ModelPreset's formulas.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from megatrain.models.presets import AttnShape, ModelPreset


@dataclass(frozen=True)
class MeasuredPreset(ModelPreset):
    """A ModelPreset whose parameter counts are the built model's: `layer_numels[i]` is decoder layer i's,
    `rest_numel` what is neither a layer nor the embedding / LM head (the final norm, ...)."""

    layer_numels: tuple[int, ...] = ()
    rest_numel: int = 0

    def layer_params(self) -> int:
        return sum(self.layer_numels) // self.num_layers

    def largest_layer_params(self) -> int:
        return max(self.layer_numels)

    def layer_sizes(self) -> list[int]:
        return list(self.layer_numels)

    def active_layer_params(self) -> int:
        return self.layer_params()  # dense: every parameter computes for every token

    def nonembed_params(self) -> int:
        return sum(self.layer_numels) + self.rest_numel

    def active_nonembed_params(self) -> int:
        return self.nonembed_params()

    def with_(self, **changes: Any) -> ModelPreset:
        """The same model under another name or position limit keeps its measured counts; a changed shape (a
        one-layer toy of it, ...) is a plain ModelPreset counted by its formulas."""
        if set(changes) <= {"name", "max_positions", "rope_theta"}:
            return replace(self, **changes)
        return ModelPreset(**{**{f.name: getattr(self, f.name) for f in fields(ModelPreset)}, **changes})


def _numel(module: Any) -> int:
    return sum(p.numel() for p in module.parameters())


def _linear_out(layer: Any, names: tuple[str, ...]) -> Any:
    """The first nn.Linear of the layer named one of `names` (q_proj, ...), or None."""
    import torch

    for name, m in layer.named_modules():
        if name.rsplit(".", 1)[-1] in names and isinstance(m, torch.nn.Linear):
            return m
    return None


def build_on_meta(cfg: Any) -> Any:
    """transformers' causal LM for `cfg` on the meta device (shapes only: nothing allocated, nothing loaded)."""
    import torch
    import transformers

    try:
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(cfg)
    except (ValueError, KeyError, ImportError, TypeError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__  # not transformers' list of every type
        raise ValueError(f"transformers cannot build a causal LM for model_type {cfg.model_type!r} ({first}); the "
                         "engine trains decoder-only causal LMs (describe another model as a ModelPreset)") from None


def measured_preset(cfg: Any, name: str, family: str, max_positions: int, rope_theta: float) -> MeasuredPreset:
    """The planner's shape of the dense decoder-only model `cfg` describes, read off the model built on meta.
    `family` names the transformers config class that rebuilds it (preset_configs.py), else its model_type."""
    from megatrain.models.adapter import find_parts

    model = build_on_meta(cfg)
    tcfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    parts = find_parts(model)  # ValueError naming what the engine cannot train
    layers, emb, head, tied = parts.layers, parts.embed, parts.lm_head, parts.tied
    n_layers = len(layers)
    vocab, hidden = (int(x) for x in emb.weight.shape)
    counted = {id(p) for p in layers.parameters()} | {id(emb.weight)} | (set() if tied else {id(head.weight)})
    rest = sum(p.numel() for p in model.parameters() if id(p) not in counted)
    first = layers[0]
    q, k = _linear_out(first, ("q_proj", "query")), _linear_out(first, ("k_proj", "key"))
    o = _linear_out(first, ("o_proj", "out_proj", "dense"))
    heads = int(tcfg.num_attention_heads)
    head_dim = int(getattr(tcfg, "head_dim", None) or hidden // heads)
    kv_heads = int(k.out_features // head_dim) if k is not None else int(getattr(tcfg, "num_key_value_heads", heads)
                                                                          or heads)
    up = _linear_out(first, ("up_proj", "fc1", "c_fc", "w1"))
    intermediate = int(up.out_features if up is not None else getattr(tcfg, "intermediate_size", None) or 4 * hidden)
    norms = {n.rsplit(".", 1)[-1] for n, _ in first.named_modules()}
    window = int(getattr(tcfg, "sliding_window", None) or 0)
    types = list(getattr(tcfg, "layer_types", None) or ())
    sliding = sum(t == "sliding_attention" for t in types) if types else (n_layers if window else 0)
    attn = AttnShape(head_dim=head_dim if head_dim != hidden // heads else 0,
                     qkv_bias=q is not None and q.bias is not None, o_bias=o is not None and o.bias is not None,
                     qk_norm="q_norm" in norms, sliding_window=window if sliding else 0,
                     sliding_layers=sliding if window else 0)
    return MeasuredPreset(name=name, family=family, num_layers=n_layers, hidden=hidden,
                          intermediate=intermediate, heads=heads, kv_heads=kv_heads, vocab=vocab,
                          max_positions=max_positions, tie_embeddings=tied, rope_theta=rope_theta, attn=attn,
                          layer_numels=tuple(_numel(layer) for layer in layers), rest_numel=rest)
