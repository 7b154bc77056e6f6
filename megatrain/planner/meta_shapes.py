"""A decoder-only model's shape read off the model itself: transformers builds it from its config on the meta
device (no memory, no weights), the engine's own adapter (models/adapter.py: find_parts) finds its decoder layers,
embedding, head and final norm exactly as training will, refusing what the engine refuses, and the planner takes
each layer's parameter count and the attention and MLP widths from the modules, whatever the model_type (Llama,
Qwen3, Gemma, OLMo, GPT-2, and mixtures of experts the planner has no formula reader for: OLMoE, DeepSeek-V4,
GLM-5, ...). Layers may differ (per-layer head_dim, dense and sparse MLPs, hyper-connections, indexers): each is
counted as built.

The counts are the model's own (those beside the layers, embedding, head and final norm too: `side_params`, Gemma
3n/4's per-layer input tables), as are the residual streams between layers (`residual_streams`: hyper-connections'
hc_mult), so host memory, streaming and the optimizer are planned from what the engine will
store; a token computes with every parameter of a layer but the routed experts it is not sent to (top-k of them);
the compute side's widths (FLOPs, activations) go through ModelPreset's formulas.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from megatrain.models.presets import AttnShape, MLAShape, ModelPreset, MoEShape

from ..costs.memory import residual_streams

# config keys naming a mixture's routed-expert count and how many of them a token is sent to, across families
_EXPERT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts", "n_experts")
_TOPK_KEYS = ("num_experts_per_tok", "top_k_experts", "moe_topk", "moe_top_k", "num_selected_experts", "moe_k",
              "top_k")


@dataclass(frozen=True)
class MeasuredPreset(ModelPreset):
    """A ModelPreset whose parameter counts are the built model's: `layer_numels[i]` is decoder layer i's,
    `rest_numel` what is neither a layer nor the embedding / LM head (the final norm, ...)."""

    layer_numels: tuple[int, ...] = ()
    rest_numel: int = 0
    # per layer, what one token computes with (the routed experts it is not sent to left out); () = layer_numels
    active_layer_numels: tuple[int, ...] = ()

    def _active(self) -> tuple[int, ...]:
        return self.active_layer_numels or self.layer_numels

    def layer_params(self) -> int:
        return sum(self.layer_numels) // self.num_layers

    def largest_layer_params(self) -> int:
        return max(self.layer_numels)

    def layer_sizes(self) -> list[int]:
        return list(self.layer_numels)

    def active_layer_params(self) -> int:
        return sum(self._active()) // self.num_layers

    def nonembed_params(self) -> int:
        return sum(self.layer_numels) + self.rest_numel

    def active_nonembed_params(self) -> int:
        return sum(self._active()) + self.rest_numel

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
    """transformers' causal LM for `cfg` on the meta device (shapes only: nothing allocated, nothing loaded). Built
    from a copy: from_config sets the attention implementation on the config it is handed, and the caller's must
    keep its own (a model built from it later would run eager attention)."""
    import copy

    import torch
    import transformers

    try:
        with torch.device("meta"):  # eager attention: the shapes are the same, and every model type builds with it
            return transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager")
    except (ValueError, KeyError, ImportError, TypeError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__  # not transformers' list of every type
        raise ValueError(f"transformers cannot build a causal LM for model_type {cfg.model_type!r} ({first}); the "
                         "engine trains decoder-only causal LMs (describe another model as a ModelPreset)") from None


def config_value(cfg: Any, *names: str) -> Any:
    """The first of `names` the config sets (not None), else None. A per-layer attribute (Gemma-4's head_dim, whose
    global read transformers refuses with an error of its own) counts as unset: the layers are read instead."""
    for name in names:
        try:
            v = getattr(cfg, name, None)
        except Exception:  # noqa: BLE001 - transformers' per-layer-attribute error is no AttributeError
            v = None
        if v is not None:
            return v
    return None


def mixture_value(cfg: Any, *names: str) -> Any:
    """`config_value`, then the same names one level down in a section of the config (DBRX keeps its mixture's
    settings in `ffn_config`: moe_num_experts, moe_top_k)."""
    v = config_value(cfg, *names)
    if v is not None:
        return v
    for section in vars(cfg).values() if hasattr(cfg, "__dict__") else ():
        if isinstance(section, dict):
            v = next((section[n] for n in names if section.get(n) is not None), None)
        elif hasattr(section, "to_dict") and section is not cfg:
            v = config_value(section, *names)
        if v is not None:
            return v
    return None


def _expert_modules(layer: Any) -> list[Any]:
    """The routed-expert containers of a decoder layer (modules named `experts`, outermost only)."""
    found: list[tuple[str, Any]] = []
    for name, m in layer.named_modules():
        if name.rsplit(".", 1)[-1] == "experts" and not any(name.startswith(f + ".") for f, _ in found):
            found.append((name, m))
    return [m for _, m in found]


def _expert_count(cfg: Any, experts: Any) -> int:
    """Routed experts per sparse layer: the config's count, else the container's (a list, or a stacked tensor)."""
    n = mixture_value(cfg, *_EXPERT_KEYS)
    if n:
        return int(n)
    if hasattr(experts, "__len__"):
        return len(experts)
    return int(next(experts.parameters()).shape[0])


def _moe(cfg: Any, layers: Any, hidden: int, numels: tuple[int, ...]) -> tuple[MoEShape | None, tuple[int, ...]]:
    """The mixture's shape and each layer's active count, or (None, ()) for a dense model."""
    per_layer = [_expert_modules(layer) for layer in layers]
    sparse = [i for i, ex in enumerate(per_layer) if ex]
    if not sparse:
        return None, ()
    first = per_layer[sparse[0]][0]
    experts = _expert_count(cfg, first)
    top_k = mixture_value(cfg, *_TOPK_KEYS)
    if not top_k:
        raise ValueError(f"the model has {experts} routed experts per layer but its config names no top-k (one of "
                         f"{', '.join(_TOPK_KEYS)}); set num_experts_per_tok in config.json")
    top_k = int(top_k)
    active = tuple(n - sum(_numel(e) for e in ex) * (experts - top_k) // experts for n, ex in zip(numels, per_layer))
    width = config_value(cfg, "moe_intermediate_size", "expert_intermediate_size")
    width = int(width or _numel(first) // max(1, experts * 3 * hidden))
    shared_mod = next((m for n, m in layers[sparse[0]].named_modules()
                       if n.rsplit(".", 1)[-1] in ("shared_experts", "shared_expert", "shared_mlp")), None)
    shared = _numel(shared_mod) // (3 * hidden) if shared_mod is not None else 0
    return MoEShape(experts=experts, top_k=top_k, expert_intermediate=width, shared_intermediate=shared,
                    dense_layers=len(layers) - len(sparse)), active


def _head_dim(cfg: Any, layers: Any, heads: int, hidden: int) -> int:
    """The attention head width: the config's where it has one for every layer, else the widest layer's query
    projection per head (Gemma-4 sets head_dim per layer), else hidden / heads."""
    hd = config_value(cfg, "head_dim")
    if hd:
        return int(hd)
    widths = [q.out_features // heads for layer in layers
              if (q := _linear_out(layer, ("q_proj", "q_b_proj", "query"))) is not None]
    return max(widths) if widths else hidden // heads


def _mla(cfg: Any) -> MLAShape | None:
    """Latent attention's widths where the config has them (GLM-5, DeepSeek-V2/3 style): the attention FLOPs'
    query-key width is theirs, not head_dim's (which such configs use for the rotary part)."""
    ranks = [config_value(cfg, k) for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")]
    if not all(ranks):
        return None
    q_lora = config_value(cfg, "q_lora_rank")
    return MLAShape(int(q_lora) if q_lora else None, *(int(r) for r in ranks))


def measured_preset(cfg: Any, name: str, family: str, max_positions: int, rope_theta: float) -> MeasuredPreset:
    """The planner's shape of the decoder-only model `cfg` describes, read off the model built on meta.
    `family` names the transformers config class that rebuilds it (preset_configs.py), else its model_type."""
    from megatrain.models.adapter import find_parts
    from megatrain.models.side import side_numel

    model = build_on_meta(cfg)
    tcfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    parts = find_parts(model)  # ValueError naming what the engine cannot train
    layers, emb, head, tied = parts.layers, parts.embed, parts.lm_head, parts.tied
    n_layers = len(layers)
    vocab, hidden = (int(x) for x in emb.weight.shape)
    counted = {id(p) for p in layers.parameters()} | {id(emb.weight)} | (set() if tied else {id(head.weight)})
    rest = sum(p.numel() for p in model.parameters() if id(p) not in counted)
    side = side_numel(parts)  # the engine's own count (models/side.py)
    numels = tuple(_numel(layer) for layer in layers)
    moe, active = _moe(tcfg, layers, hidden, numels)
    first = layers[0]
    q, k = _linear_out(first, ("q_proj", "query")), _linear_out(first, ("k_proj", "key"))
    o = _linear_out(first, ("o_proj", "out_proj", "dense"))
    heads = int(config_value(tcfg, "num_attention_heads", "n_head", "num_heads") or 1)
    head_dim = _head_dim(tcfg, layers, heads, hidden)
    kv_heads = int(k.out_features // head_dim) if k is not None and k.out_features % head_dim == 0 else \
        int(config_value(tcfg, "num_key_value_heads") or heads)
    up = _linear_out(first, ("up_proj", "fc1", "c_fc", "w1"))
    intermediate = int(up.out_features if up is not None else config_value(tcfg, "intermediate_size")
                       or (moe.expert_intermediate if moe else 4 * hidden))
    norms = {n.rsplit(".", 1)[-1] for n, _ in first.named_modules()}
    window = int(config_value(tcfg, "sliding_window") or 0)
    types = list(config_value(tcfg, "layer_types") or ())
    sliding = sum(t == "sliding_attention" for t in types) if types else (n_layers if window else 0)
    attn = AttnShape(head_dim=head_dim if head_dim != hidden // heads else 0,
                     qkv_bias=q is not None and q.bias is not None, o_bias=o is not None and o.bias is not None,
                     qk_norm="q_norm" in norms, sliding_window=window if sliding else 0,
                     sliding_layers=sliding if window else 0, mla=_mla(tcfg))
    return MeasuredPreset(name=name, family=family, num_layers=n_layers, hidden=hidden,
                          intermediate=intermediate, heads=heads, kv_heads=kv_heads, vocab=vocab,
                          max_positions=max_positions, tie_embeddings=tied, rope_theta=rope_theta, attn=attn, moe=moe,
                          layer_numels=numels, rest_numel=rest, active_layer_numels=active,
                          residual_streams=residual_streams(tcfg), side_params=side)
