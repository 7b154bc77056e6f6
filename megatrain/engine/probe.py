"""The parity probe: before the engine trains an architecture, it proves it trains it exactly.

The engine reproduces a Hugging Face model from its parts (embedding, streamed decoder layers, final norm,
chunked head and loss). Any math the model does elsewhere (a scale in the wrapper, a softcap, inputs shared
across layers) would be silently dropped. So on first use of an architecture the engine builds a tiny model of
the same class and structural options (2 layers, small widths, every setting that is not a size kept), trains
it a few steps with plain PyTorch and through the engine on the same batches, and compares first-step
gradients and per-step losses. A mismatch refuses the real model and names the first parameter that differs.

The verdict is cached per (model class, structural options, transformers version) in
`$MEGATRAIN_CACHE` (default `~/.cache/megatrain`), so the real run pays about a second once.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import os
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

# First-step gradients relative to the tensor's largest entry, floored at 1e-2 of the model's largest gradient:
# gradients that are zero in exact arithmetic are rounding noise (measured: BioGPT's key bias, whose gradient is
# exactly zero since softmax ignores a shift of all keys, at 1.6e-8 of the largest gradient). Summation order gives
# up to ~4e-6 elsewhere; real defects give 1e-3 and more (Gemma's ignored embedding scale: 0.9).
# The steps are plain SGD: an update linear in the gradient, so a wrong gradient anywhere moves the next loss,
# while Adam would turn rounding noise in near-zero gradients into +-lr updates and blur the comparison.
GRAD_RTOL = 1e-5
LOSS_ATOL = 1e-5
STEPS = 3
LR = 0.05

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
}
# Mixture of experts: top-k and expert groups within the shrunk expert count; the router loss on and weighted so a
# wrong router gradient shows (the model's defaults, e.g. 0.001, would put it under the tolerance).
_EXPERT_COUNTS = {"num_experts_per_tok": 2, "num_experts_per_token": 2, "n_group": 2, "num_expert_group": 2,
                  "topk_group": 1}
_ROUTER_AUX_COEF = 0.1
_MAX_PARAMS = 20_000_000  # a "tiny" clone bigger than this has a size setting the probe does not know
_VOCAB = 256
_SEQ = 24


class ModelMismatchError(ValueError):
    """The parity probe found that the engine would train this architecture differently from PyTorch."""


@dataclass
class Verdict:
    status: str  # "exact" | "mismatch" | "refused" | "crashed"
    detail: str  # why (empty when exact)
    architecture: str  # the model class
    max_grad_rel: float | None = None  # worst first-step gradient error, relative (see GRAD_RTOL)
    max_loss_diff: float | None = None  # worst per-step loss difference
    transformers_version: str = transformers.__version__

    @property
    def exact(self) -> bool:
        return self.status == "exact"


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
    cfg = copy.deepcopy(config)
    present = vars(cfg)  # not getattr: heterogeneous configs raise on per-layer attributes read globally
    for key, value in list(present.items()):
        if isinstance(value, transformers.PretrainedConfig):  # composite models: text_config, vision_config, ...
            setattr(cfg, key, tiny_config(value))
    for key, value in {**_SIZES, **_MORE_SIZES}.items():
        if key == "head_dim" and "qk_rope_head_dim" in present:
            continue  # latent attention: head_dim is tied to the rotary part's width
        if isinstance(present.get(key), int) and not isinstance(present.get(key), bool) and present[key] > value:
            setattr(cfg, key, value)
    for key, value in _EXPERT_COUNTS.items():
        if isinstance(present.get(key), int) and not isinstance(present.get(key), bool) and present[key] > value:
            setattr(cfg, key, value)
    if present.get("num_experts_per_tok", 0) is None and any(present.get(k) for k in ("n_routed_experts", "num_experts")):
        cfg.num_experts_per_tok = 2  # a default without top-k (DeepSeek-V2) cannot route at all
    _keep_both_layer_kinds(cfg, present)
    if "output_router_logits" in present:
        cfg.output_router_logits = True
        if isinstance(present.get("router_aux_loss_coef"), float):
            cfg.router_aux_loss_coef = _ROUTER_AUX_COEF
    heads = vars(cfg).get("num_attention_heads") or vars(cfg).get("n_head") or _SIZES["num_attention_heads"]
    kv = _kv_heads(config, heads)
    if kv is not None:
        cfg.num_key_value_heads = kv
    if present.get("word_embed_proj_dim") is not None and present["word_embed_proj_dim"] == vars(config).get("hidden_size"):
        cfg.word_embed_proj_dim = cfg.hidden_size  # OPT: no projection around the layers unless the original has one
    if isinstance(present.get("layer_types"), list):
        cfg.layer_types = _two_layer_types(cfg.layer_types)
    if isinstance(present.get("sliding_window"), int) and cfg.sliding_window:
        cfg.sliding_window = 8  # shorter than the probe's sequence, so the window really cuts
    for key, value in list(vars(cfg).items()):
        if isinstance(value, float) and ("dropout" in key or key.endswith("pdrop")):
            setattr(cfg, key, 0.0)
    # Token ids must exist in the shrunk vocabulary; the padding id shapes the embedding (padding_idx).
    for key, small in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2)):
        if present.get(key) is not None:
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


def _build(model_cls: type, cfg: Any, original: Any) -> nn.Module:
    try:
        n = sum(p.numel() for p in _instantiate(model_cls, cfg, meta=True).parameters())
    except Exception as exc:
        try:  # is it the shrinking, or does transformers not build this config at all?
            _instantiate(model_cls, copy.deepcopy(original), meta=True)
        except Exception:  # noqa: BLE001
            raise ValueError(f"transformers cannot build its default config either ({type(exc).__name__}: "
                             f"{exc})") from exc
        raise
    if n > _MAX_PARAMS:
        raise ValueError(f"the shrunk config still has {n:,} parameters: it has a size setting the probe does not "
                         "know how to shrink")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return _instantiate(model_cls, cfg, meta=False)


def cache_key(model_cls: type, config: Any) -> str:
    """What the verdict depends on: class, structural options (sizes excluded), library versions."""
    try:
        tiny = tiny_config(config).to_dict()
    except Exception:  # noqa: BLE001 - a config the probe cannot shrink is keyed (and then refused) as it is
        tiny = config.to_dict()
    options = {k: v for k, v in tiny.items() if k not in _IGNORED_KEYS and k not in _SIZES and k not in _MORE_SIZES}
    blob = json.dumps([f"{model_cls.__module__}.{model_cls.__qualname__}", options, transformers.__version__,
                       torch.__version__.split("+")[0]], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _cache_dir() -> Path:
    return Path(os.environ.get("MEGATRAIN_CACHE") or Path.home() / ".cache" / "megatrain") / "probe"


def _batches(n: int, vocab: int, seq: int, seed: int = 1234) -> list[dict[str, torch.Tensor]]:
    """Left padding on one row and a few unlabelled tokens: the masks and the loss's ignore path are exercised."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, vocab, (2, seq), generator=g)
        mask = torch.ones_like(ids)
        mask[1, : seq // 4] = 0
        labels = ids.masked_fill(mask == 0, -100)
        labels[0, torch.randint(0, seq, (3,), generator=g)] = -100
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def _grad_errors(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> list[tuple[str, float]]:
    scale = max((g.abs().max().item() for g in ref.values()), default=0.0)
    out = []
    for name, g in ref.items():
        e = got.get(name)
        if e is None:
            out.append((name, math.inf))
            continue
        floor = max(g.abs().max().item(), 1e-2 * scale, 1e-30)
        out.append((name, (e - g).abs().max().item() / floor))
    return out


def _ours(exc: BaseException) -> bool:
    """Whether MegaTrain itself raised `exc` (a refusal by name), rather than the model's code failing under it."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and str(tb.tb_frame.f_globals.get("__name__", "")).startswith("megatrain")


def run_probe(model_cls: type, config: Any, engine_factory: Callable[..., Any]) -> Verdict:
    """Build a tiny `model_cls` of `config`'s structure and compare PyTorch and the engine on it."""
    from ..config import EngineConfig  # the engine's own settings; a leaf module

    arch = model_cls.__name__
    try:
        tiny = tiny_config(config)
        ref = _build(model_cls, tiny, config)
        ref.float().train()
        mine = copy.deepcopy(ref)
    except Exception as exc:  # noqa: BLE001 - any failure to build is reported, never swallowed silently
        return Verdict("crashed", f"could not build a small {arch}: {type(exc).__name__}: {exc}", arch)
    try:
        engine = engine_factory(mine, EngineConfig(device="cpu", parity_probe=False),
                                optimizer=torch.optim.SGD(mine.parameters(), lr=LR))
    except Exception as exc:  # noqa: BLE001
        if isinstance(exc, ValueError | NotImplementedError) and _ours(exc):
            return Verdict("refused", str(exc), arch)
        return Verdict("crashed", f"the engine failed to take a small {arch}: {type(exc).__name__}: {exc}", arch)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    max_pos = vars(tiny).get("max_position_embeddings")
    seq = min(_SEQ, max_pos) if isinstance(max_pos, int) and max_pos > 0 else _SEQ
    batches = _batches(STEPS, vars(tiny).get("vocab_size") or _VOCAB, seq)
    worst_loss, worst_grad = 0.0, 0.0
    # Both runs of a step draw the same random numbers (PhiMoE's router samples its experts while training), and
    # the caller's random stream is left as it was.
    try:
        with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
            warnings.simplefilter("ignore")
            for step, batch in enumerate(batches):
                try:
                    torch.manual_seed(step)
                    ref_loss = ref(**batch).loss
                    ref_loss.backward()
                except Exception as exc:  # noqa: BLE001
                    return Verdict("crashed", f"plain transformers fails to train the small {arch} (the probe's "
                                   f"shrunk config): {type(exc).__name__}: {exc}", arch)
                torch.manual_seed(step)
                loss = engine(**batch).loss
                engine.backward(loss)
                if step == 0:
                    engine.synchronize()
                    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
                    got = {n: p.grad for n, p in engine.named_parameters()}
                    errors = _grad_errors(ref_grads, {**got, **{a: got[n] for a, n in engine._aliases.items()}})
                    worst_grad = max((e for _, e in errors), default=0.0)
                    bad = next(((n, e) for n, e in errors if not e <= GRAD_RTOL), None)
                    if bad is not None:
                        return Verdict("mismatch", f"the gradient of {bad[0]} differs from PyTorch's by {bad[1]:.2e} "
                                       f"(relative; tolerance {GRAD_RTOL:g})", arch, worst_grad)
                diff = abs(ref_loss.item() - loss.item())
                worst_loss = max(worst_loss, diff)
                if not diff <= LOSS_ATOL:
                    return Verdict("mismatch", f"the loss of step {step} differs from PyTorch's by {diff:.2e} "
                                   f"(tolerance {LOSS_ATOL:g}); first-step gradients agreed", arch, worst_grad, diff)
                opt.step()
                opt.zero_grad()
                engine.step()
                engine.zero_grad()
    except Exception as exc:  # noqa: BLE001
        if isinstance(exc, ValueError | NotImplementedError) and _ours(exc):
            return Verdict("refused", str(exc), arch, worst_grad or None)
        return Verdict("crashed", f"training a small {arch} failed: {type(exc).__name__}: {exc}", arch)
    finally:
        engine.synchronize()
    return Verdict("exact", "", arch, worst_grad, worst_loss)


_MEMO: dict[str, Verdict] = {}


def verify_model(model: nn.Module, engine_factory: Callable[..., Any]) -> Verdict:
    """Run (or recall) the probe for `model`'s architecture; raise `ModelMismatchError` unless it is exact."""
    model_cls, config = type(model), model.config
    key = cache_key(model_cls, config)
    verdict = _MEMO.get(key)
    path = _cache_dir() / f"{key}.json"
    if verdict is None and path.exists():
        try:
            verdict = Verdict(**json.loads(path.read_text()))
        except (ValueError, TypeError):
            verdict = None  # a damaged cache entry is re-probed, never trusted
    if verdict is None:
        # The probe trains: a first forward under the caller's no_grad() or inference_mode() (an evaluation
        # before training) must not turn into a refusal of the architecture.
        with torch.inference_mode(False), torch.enable_grad():
            verdict = run_probe(model_cls, config, engine_factory)
        _MEMO[key] = verdict
        if verdict.status in ("exact", "mismatch"):  # refusals and crashes may depend on the environment
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(asdict(verdict)))
                tmp.replace(path)
            except OSError:
                pass  # an unwritable cache costs a re-probe next time, nothing else
    if not verdict.exact:
        why = {"mismatch": "a small model of the same class and options trained through MegaTrain does not match "
                           "plain PyTorch, so the real one would train wrong",
               "refused": "MegaTrain cannot train this architecture exactly",
               "crashed": "the probe could not show that MegaTrain trains this architecture exactly"}[verdict.status]
        raise ModelMismatchError(
            f"MegaTrain's parity probe refuses {verdict.architecture} ({verdict.status}): {verdict.detail}. In short, "
            f"{why}. Train it with another backend; or, only if you know the difference is harmless, turn the probe "
            "off with EngineConfig(parity_probe=False) (ds_config: \"megatrain\": {\"parity_probe\": false})")
    return verdict
