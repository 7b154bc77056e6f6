"""The parity probe's model sizes: the user's config shrunk to a tiny clone of the same class and structural options
(every setting that is not a size kept), less shrunk, or cut to two layers, and the clone built from it."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import torch
import transformers
from torch import nn

# Settings that are sizes (or token ids, names, bookkeeping): shrunk or dropped, never part of the cache key.
_SIZES = {
    "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "head_dim": 16, "vocab_size": 256,
    "num_hidden_layers": 2,
}

_IGNORED_KEYS = {"_name_or_path", "transformers_version", "architectures", "dtype", "torch_dtype", "_commit_hash",
                 "pad_token_id", "bos_token_id", "eos_token_id", "use_cache", "output_attentions",
                 "output_hidden_states", "return_dict", "_attn_implementation_autoset", "auto_map"}

# More sizes some families add (per-layer input tables, expert widths, low-rank attention): shrunk when present.
_MORE_SIZES = {
    "vocab_size_per_layer_input": 256, "hidden_size_per_layer_input": 16, "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64, "n_routed_experts": 4, "num_experts": 4, "num_local_experts": 4,
    "kv_lora_rank": 16, "q_lora_rank": 32, "rotary_dim": 8,
    "n_positions": 512, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_inner": 128, "ffn_dim": 128, "d_model": 64,
    "num_layers": 2, "ffn_hidden_size": 128, "expert_ffn_hidden_size": 64, "emb_dim": 64,  # LongCat, XLM
    "attention_hidden_size": 128, "attention_head_dim": 32,  # Zamba's shared attention block
    "encoder_hash_byte_group_vocab": 256,  # BLT's hashed n-gram tables
}

# Mixture of experts: top-k and expert groups within the shrunk expert count; the router loss on and weighted so a
# wrong router gradient shows (the model's defaults, e.g. 0.001, would put it under the tolerance).
_EXPERT_COUNTS = {"num_experts_per_tok": 2, "num_experts_per_token": 2, "n_group": 2, "num_expert_group": 2,
                  "topk_group": 1, "moe_topk": 2, "zero_expert_num": 2}

_ROUTER_AUX_COEF = 0.1

_MAX_PARAMS = 20_000_000  # a "tiny" clone bigger than this has a size setting the probe does not know

# When plain transformers fails on the shrunk config, the probe shrinks less: the same counts, every width kept
# (_FEWER); then the user's config cut to two layers (_TWO_LAYERS). Bigger models, so a bigger cap.
_FEWER = {"num_hidden_layers": 2, "n_layer": 2, "vocab_size": 256, "vocab_size_per_layer_input": 256,
          "n_routed_experts": 4, "num_experts": 4, "num_local_experts": 4}

_TWO_LAYERS = {"num_hidden_layers": 2, "n_layer": 2}

_MAX_PARAMS_LESS = 100_000_000

def _kv_heads(config: Any, heads: int) -> int | None:
    kv = vars(config).get("num_key_value_heads")
    orig = vars(config).get("num_attention_heads")
    if kv is None:
        return None
    if orig and kv == orig:
        return heads  # multi-head attention stays multi-head
    return 1 if kv == 1 else 2  # multi-query stays multi-query, grouped stays grouped

def _two_layer_types(types: list) -> list:
    """Two layers that keep every kind the model mixes, when there are two kinds (sliding + full attention)."""
    kinds = list(dict.fromkeys(types))
    return (kinds + kinds)[:2] if len(kinds) >= 2 else list(types[:2])

def _keep_both_layer_kinds(cfg: Any, present: dict) -> None:
    """Two layers that still hold an expert layer and an attention layer where the model mixes kinds."""
    n = cfg.num_hidden_layers if isinstance(vars(cfg).get("num_hidden_layers"), int) else None
    if isinstance(present.get("mlp_layer_types"), list):
        cfg.mlp_layer_types = _two_layer_types(cfg.mlp_layer_types)
    dense = present.get("mlp_only_layers")
    if n and isinstance(dense, list) and dense and all(i in dense for i in range(n)):
        cfg.mlp_only_layers = [0]  # every shrunk layer dense: keep the first, route the second
    first_dense = present.get("first_k_dense_replace")
    if n and isinstance(first_dense, int) and not isinstance(first_dense, bool) and first_dense >= n:
        cfg.first_k_dense_replace = n - 1
    for kind in ("attn", "expert"):  # Jamba: a kind every `period` layers from `offset`
        period, offset = present.get(f"{kind}_layer_period"), present.get(f"{kind}_layer_offset")
        if n and isinstance(period, int) and isinstance(offset, int) and offset >= n:
            setattr(cfg, f"{kind}_layer_period", 2)
            setattr(cfg, f"{kind}_layer_offset", 1)

def tiny_config(config: Any) -> Any:
    """A copy of `config` with model sizes shrunk to a CPU's seconds and dropout off; structure kept."""
    return _shrunk(config, {**_SIZES, **_MORE_SIZES}, _EXPERT_COUNTS, tiny_config)

def less_shrunk_config(config: Any) -> Any:
    """`config` with 2 layers, 4 experts and a small vocabulary only: the user's widths, head dims, low ranks and
    expert shapes kept (for a config the full shrink breaks, e.g. heads that no longer divide)."""
    return _shrunk(config, _FEWER, _EXPERT_COUNTS, less_shrunk_config)

def two_layer_config(config: Any) -> Any:
    """The user's own config cut to two layers (dropout off); everything else as given."""
    return _shrunk(config, _TWO_LAYERS, {}, two_layer_config)

def _shrunk(config: Any, sizes: dict[str, int], expert_counts: dict[str, int], recurse: Callable[[Any], Any]) -> Any:
    cfg = copy.deepcopy(config)
    present = vars(cfg)  # not getattr: heterogeneous configs raise on per-layer attributes read globally
    for key, value in list(present.items()):
        if isinstance(value, transformers.PretrainedConfig):  # composite models: text_config, vision_config, ...
            setattr(cfg, key, recurse(value))
    for key, value in sizes.items():
        if key == "head_dim" and "qk_rope_head_dim" in present:
            continue  # latent attention: head_dim is tied to the rotary part's width
        if isinstance(present.get(key), int) and not isinstance(present.get(key), bool) and present[key] > value:
            setattr(cfg, key, value)
    for key, value in expert_counts.items():
        if isinstance(present.get(key), int) and not isinstance(present.get(key), bool) and present[key] > value:
            setattr(cfg, key, value)
    if expert_counts and present.get("num_experts_per_tok", 0) is None and any(
            present.get(k) for k in ("n_routed_experts", "num_experts")):
        cfg.num_experts_per_tok = 2  # a default without top-k (DeepSeek-V2) cannot route at all
    _keep_both_layer_kinds(cfg, present)
    n_orig, n = vars(config).get("num_hidden_layers"), vars(cfg).get("num_hidden_layers")
    if present.get("num_kv_shared_layers") and present["num_kv_shared_layers"] == n_orig:
        cfg.num_kv_shared_layers = n  # every layer reads shared keys/values (an assistant drafting from its target)
    if "output_router_logits" in present:
        cfg.output_router_logits = True
        if isinstance(present.get("router_aux_loss_coef"), float):
            cfg.router_aux_loss_coef = _ROUTER_AUX_COEF
    if "num_attention_heads" in sizes:
        heads = vars(cfg).get("num_attention_heads") or vars(cfg).get("n_head") or _SIZES["num_attention_heads"]
        kv = _kv_heads(config, heads)
        if kv is not None:
            cfg.num_key_value_heads = kv
    if present.get("word_embed_proj_dim") is not None and present["word_embed_proj_dim"] == vars(config).get("hidden_size"):
        cfg.word_embed_proj_dim = cfg.hidden_size  # OPT: no projection around the layers unless the original has one
    if isinstance(present.get("layer_types"), list):
        cfg.layer_types = _two_layer_types(cfg.layer_types)
    if isinstance(present.get("sliding_window"), int) and cfg.sliding_window and sizes is not _TWO_LAYERS:
        cfg.sliding_window = 8  # shorter than the probe's sequence, so the window really cuts
    for key, value in list(vars(cfg).items()):
        if isinstance(value, float) and ("dropout" in key or key.endswith("pdrop")):
            setattr(cfg, key, 0.0)
    # Token ids must exist in the shrunk vocabulary; the padding id shapes the embedding (padding_idx).
    for key, small in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2)):
        if present.get(key) is not None and "vocab_size" in sizes:
            setattr(cfg, key, small)
    if isinstance(present.get("initializer_range"), float):
        # Larger weights than a fresh model's: logits and activations far from zero, where a dropped near-identity
        # transform (a softcap, a small scale) changes the numbers visibly.
        cfg.initializer_range = 0.1
    cfg._attn_implementation = "eager" if getattr(config, "_attn_implementation", None) == "eager" else "sdpa"
    return cfg

def _instantiate(model_cls: type, cfg: Any, meta: bool) -> nn.Module:
    """`model_cls(cfg)`, with eager attention for architectures that have no SDPA path."""
    try:
        with torch.device("meta") if meta else contextlib.nullcontext():
            return model_cls(copy.deepcopy(cfg) if meta else cfg)
    except ValueError as exc:
        if "attention implementation" not in str(exc) or cfg._attn_implementation == "eager":
            raise
    cfg._attn_implementation = "eager"
    return _instantiate(model_cls, cfg, meta)

class _MissingPackage(ImportError):
    """transformers cannot build the model here at all: an optional package it needs is not installed."""

def _build(model_cls: type, cfg: Any, original: Any, max_params: int = _MAX_PARAMS) -> nn.Module:
    try:
        n = sum(p.numel() for p in _instantiate(model_cls, cfg, meta=True).parameters())
    except Exception as exc:
        try:  # is it the shrinking, or does transformers not build this config at all?
            _instantiate(model_cls, copy.deepcopy(original), meta=True)
        except ImportError as missing:
            raise _MissingPackage(f"transformers needs a package that is not installed to build "
                                  f"{model_cls.__name__}: {' '.join(str(missing).split())}") from exc
        except Exception:  # noqa: BLE001
            raise ValueError(f"transformers cannot build its default config either ({type(exc).__name__}: "
                             f"{exc})") from exc
        raise
    if n > max_params:
        raise ValueError(f"the shrunk config still has {n:,} parameters: it has a size setting the probe does not "
                         "know how to shrink")
    with torch.random.fork_rng(devices=[]):
        _seed(0)
        model = _instantiate(model_cls, cfg, meta=False)
        _router_logits_as_plain_trains(model, original)
        return model


def _router_logits_as_plain_trains(model: nn.Module, original: Any) -> None:
    """The probe turns the router loss on (`_shrunk`) so a wrong router gradient shows; where the model then fails
    in plain transformers but trains with the user's own setting, the user's setting is what plain transformers
    trains, so the probe takes it. DeepSeek-V4's hash-routed layers record no router logits: with every layer
    hash-routed (a small config's first layers) its load-balancing loss indexes an empty tuple."""
    cfg = getattr(model, "config", None)
    mine, theirs = vars(cfg).get("output_router_logits") if cfg is not None else None, vars(original).get(
        "output_router_logits")
    if mine is not True or theirs is True:
        return
    ids = torch.arange(3, 11).remainder(max(int(vars(cfg).get("vocab_size") or 256) - 3, 1)).add(3).view(1, -1)

    buffers = {k: b.clone() for k, b in model.named_buffers()}  # a forward may move a buffer (expert load)

    def forward_fails() -> bool:
        try:
            with torch.no_grad():
                model(input_ids=ids, labels=ids)
        except Exception:  # noqa: BLE001 - any failure: the user's setting is tried next, and judged the same way
            return True
        finally:
            with torch.no_grad():
                for k, b in model.named_buffers():
                    if k in buffers and b.shape == buffers[k].shape:
                        b.copy_(buffers[k])
        return False

    if forward_fails():
        cfg.output_router_logits = bool(theirs)
        if forward_fails():
            cfg.output_router_logits = True  # not the router loss: the probe's reference reports the failure


def _seed(seed: int) -> None:
    """Seed the CPU generator only: torch.manual_seed would reseed every CUDA generator too, which fork_rng(
    devices=[]) neither saves nor restores (a script's dropout would differ between its first run and later ones).
    The probe runs on the CPU, so the CPU generator is the only one it draws from."""
    torch.random.default_generator.manual_seed(seed)
