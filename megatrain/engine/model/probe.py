"""The parity probe: before the engine trains an architecture, it proves it trains it exactly.

The engine reproduces a Hugging Face model from its parts (embedding, streamed decoder layers, final norm,
chunked head and loss). Any math the model does elsewhere (a scale in the wrapper, a softcap, inputs shared
across layers) would be silently dropped. So on first use of an architecture the engine builds a tiny model of
the same class and structural options (2 layers, small widths, every setting that is not a size kept), trains
it a few steps with plain PyTorch and through the engine on the same batches, and compares first-step
gradients and per-step losses. A mismatch refuses the real model and names the first parameter that differs.

It proves what will train: an engine that computes in bf16 (`compute_dtype`, "auto" on a GPU) is also run in bf16
and its host mode, against plain PyTorch's same mixed-precision scheme (`train_plain`: FP32 masters and gradients,
bf16 compute, the engine's cast points), within a tolerance derived from that reference's own bf16 floor
(`bf16_floor`; docs/COMPATIBILITY.md says how). When plain transformers cannot train the shrunk config, the probe
shrinks less before it refuses anything (`_shrinks`), so it never refuses what plain transformers trains.

The verdict is cached per (model class, structural options, transformers version, compute dtype and host mode) in
`$MEGATRAIN_CACHE` (default `~/.cache/megatrain`), so the real run pays about a second once. The probe draws from
the CPU generator only and restores it; no CUDA generator is touched.
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
# bf16 compute: the engine against plain PyTorch's same mixed-precision scheme (probe.train_plain), within this
# factor of the reference's own bf16 floor (probe.bf16_floor: how far rounding alone moves the reference). Two
# independent bf16 roundings of one computation differ by up to about twice the floor of either; a real defect
# (a dropped scale, a wrong cast) moves gradients by 1e-1 and more. The smallest floor used: one bf16 ulp.
BF16_FLOOR_FACTOR = 4.0
BF16_MIN_FLOOR = 2.0 ** -8
ADAM_LR = 1e-3  # the bf16 phase with hi/lo masters or bf16 gradient slabs (AdamW only, update.py)
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
        return _instantiate(model_cls, cfg, meta=False)


def _seed(seed: int) -> None:
    """Seed the CPU generator only: torch.manual_seed would reseed every CUDA generator too, which fork_rng(
    devices=[]) neither saves nor restores (a script's dropout would differ between its first run and later ones).
    The probe runs on the CPU, so the CPU generator is the only one it draws from."""
    torch.random.default_generator.manual_seed(seed)


def cache_key(model_cls: type, config: Any, engine_config: Any | None = None) -> str:
    """What the verdict depends on: class, structural options (sizes excluded), library versions, and the compute
    dtype and host modes the engine trains in."""
    try:
        tiny = tiny_config(config).to_dict()
    except Exception:  # noqa: BLE001 - a config the probe cannot shrink is keyed (and then refused) as it is
        tiny = config.to_dict()
    options = {k: v for k, v in tiny.items() if k not in _IGNORED_KEYS and k not in _SIZES and k not in _MORE_SIZES}
    mode = _Mode.of(engine_config)
    blob = json.dumps([f"{model_cls.__module__}.{model_cls.__qualname__}", options, transformers.__version__,
                       torch.__version__.split("+")[0]] + ([asdict(mode)] if mode.bf16 else []),
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _cache_dir() -> Path:
    return Path(os.environ.get("MEGATRAIN_CACHE") or Path.home() / ".cache" / "megatrain") / "probe"


def _batches(n: int, vocab: int, seq: int, seed: int = 1234, pad: bool = True) -> list[dict[str, torch.Tensor]]:
    """Left padding on one row and a few unlabelled tokens: the masks and the loss's ignore path are exercised.
    Without `pad` every position is attended (the probe's retry for models plain transformers trains only so)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, vocab, (2, seq), generator=g)
        mask = torch.ones_like(ids)
        if pad:
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


@dataclass
class _Mode:
    """What the engine the probe stands for computes in: its compute dtype and host modes (EngineConfig)."""

    compute_dtype: str = "float32"
    host_master: str = "fp32"
    host_grad_dtype: str = "float32"

    @classmethod
    def of(cls, config: Any | None) -> _Mode:
        if config is None or config.compute_dtype != "bfloat16":
            return cls()
        # host_master "bf16" rounds its masters by design (docs/HOST_MODES.md): the probe proves the computation
        # with an exact master, which is what that mode rounds.
        master = config.host_master if config.host_master in ("fp32", "hilo") else "fp32"
        return cls("bfloat16", master, config.host_grad_dtype)

    @property
    def bf16(self) -> bool:
        return self.compute_dtype == "bfloat16"


def _shrinks(config: Any) -> list[tuple[str, Callable[[Any], Any], int]]:
    """The configs the probe tries, smallest first: (what it is, how to make it, parameter cap)."""
    return [("the probe's shrunk config", tiny_config, _MAX_PARAMS),
            ("a less shrunk config (the user's widths, head dims, ranks and expert shapes; 2 layers, fewer "
             "experts)", less_shrunk_config, _MAX_PARAMS_LESS),
            ("the user's config cut to two layers", two_layer_config, _MAX_PARAMS_LESS)]


def _optimizer(mode: _Mode, bf16_phase: bool) -> Callable[[Any], torch.optim.Optimizer]:
    # The exact host modes other than the FP32 master step with torch's AdamW only (update.py); elsewhere plain
    # SGD, whose update is linear in the gradient (see GRAD_RTOL).
    if bf16_phase and (mode.host_master != "fp32" or mode.host_grad_dtype != "float32"):
        return lambda params: torch.optim.AdamW(params, lr=ADAM_LR)
    return lambda params: torch.optim.SGD(params, lr=LR)


def _cast_points(model: nn.Module, dtype: torch.dtype) -> list:
    """The engine's two casts besides the parameters' own, as hooks on a plain model: the first decoder layer takes
    its input in the compute dtype (adapter.record_layer_inputs) and the head its input in its weight's dtype
    (loss._logits). Without them a model that mixes FP32 buffers or residuals into a bf16 model would fail in the
    reference where the engine does not."""
    from ...models.adapter import find_parts

    parts = find_parts(model)

    def first_layer(mod: nn.Module, args: tuple, kwargs: dict):
        if args and torch.is_tensor(args[0]) and args[0].is_floating_point():
            return (args[0].to(dtype), *args[1:]), kwargs
        if torch.is_tensor(kwargs.get("hidden_states")):
            return args, {**kwargs, "hidden_states": kwargs["hidden_states"].to(dtype)}
        return args, kwargs

    def head(mod: nn.Module, args: tuple):
        return (args[0].to(mod.weight.dtype), *args[1:])

    return [parts.layers[0].register_forward_pre_hook(first_layer, with_kwargs=True),
            parts.lm_head.register_forward_pre_hook(head)]


def train_plain(master: nn.Module, batches: list, dtype: torch.dtype, make_opt: Callable[[Any], Any],
                attn: str | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch, the reference: per-step losses and first-step gradients (on the FP32 masters).

    FP32: the model trains itself. bf16, the engine's mixed-precision scheme: a compute copy with every parameter
    in bf16 and the buffers as they are (the engine places them so), the engine's cast points (`_cast_points`),
    gradients cast to FP32 onto the FP32 masters, the step on the masters, the masters rounded into the copy."""
    masters = copy.deepcopy(master)
    if attn is not None:
        masters.config._attn_implementation = attn
    opt = make_opt(masters.parameters())
    model, hooks = masters, []
    if dtype != torch.float32:
        model = copy.deepcopy(masters)
        for p in model.parameters():
            p.data = p.data.to(dtype)
        hooks = _cast_points(model, dtype)
    pairs = list(zip(masters.parameters(), model.parameters()))
    losses: list[float] = []
    grads: dict[str, torch.Tensor] = {}
    try:
        for step, batch in enumerate(batches):
            _seed(step)  # both runs of a step draw the same numbers (PhiMoE samples its experts while training)
            loss = model(**batch).loss
            loss.backward()
            if model is not masters:
                for pm, pc in pairs:
                    pm.grad = None if pc.grad is None else pc.grad.float()
            if step == 0:
                grads = {n: p.grad.clone() for n, p in masters.named_parameters() if p.grad is not None}
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
            if model is not masters:
                model.zero_grad()
                with torch.no_grad():
                    for pm, pc in pairs:
                        pc.copy_(pm)
    finally:
        for h in hooks:
            h.remove()
    return losses, grads


class _EngineFailure(Exception):
    def __init__(self, verdict: Verdict) -> None:
        super().__init__(verdict.detail)
        self.verdict = verdict


def _train_engine(master: nn.Module, batches: list, engine_factory: Callable[..., Any], mode: _Mode,
                  make_opt: Callable[[Any], Any], arch: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same through the engine, in `mode`; a failure raises _EngineFailure with its verdict."""
    from ...config.schema import EngineConfig  # the engine's own settings; a leaf module

    where = " in bfloat16" if mode.bf16 else ""
    mine = copy.deepcopy(master)
    cfg = EngineConfig(device="cpu", parity_probe=False, compute_dtype=mode.compute_dtype,
                       host_master=mode.host_master, host_grad_dtype=mode.host_grad_dtype)
    try:
        engine = engine_factory(mine, cfg, optimizer=make_opt(mine.parameters()))
    except Exception as exc:  # noqa: BLE001
        if isinstance(exc, ValueError | NotImplementedError) and _ours(exc):
            raise _EngineFailure(Verdict("refused", str(exc), arch)) from exc
        raise _EngineFailure(Verdict("crashed", f"the engine failed to take a small {arch}{where}: "
                                     f"{type(exc).__name__}: {exc}", arch)) from exc
    losses: list[float] = []
    grads: dict[str, torch.Tensor] = {}
    try:
        for step, batch in enumerate(batches):
            _seed(step)
            loss = engine(**batch).loss
            engine.backward(loss)
            if step == 0:
                engine.synchronize()
                got = _slab_grads(engine) if mode.bf16 else {
                    n: p.grad.float().clone() for n, p in engine.named_parameters() if p.grad is not None}
                grads = {**got, **{a: got[n] for a, n in engine._aliases.items() if n in got}}
            losses.append(loss.item())
            engine.step()
            engine.zero_grad()
    except Exception as exc:  # noqa: BLE001
        if isinstance(exc, ValueError | NotImplementedError) and _ours(exc):
            raise _EngineFailure(Verdict("refused", str(exc), arch)) from exc
        hint = "; train it with compute_dtype='float32'" if mode.bf16 else ""
        raise _EngineFailure(Verdict("crashed", f"training a small {arch}{where} failed: {type(exc).__name__}: "
                                     f"{exc}{hint}", arch)) from exc
    finally:
        engine.synchronize()
    return losses, grads


def _slab_grads(engine: Any) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as the host slabs hold it, widened to FP32: in the bf16 modes a layer's `.grad` is
    not a view of its slab (hi/lo masters' parameters are copies; bf16 slabs are read through the FP32 masters)."""
    engine._all_grads()
    return {n: g.view(g.grad, s).float().clone() for n, (g, s) in engine.placement.slots_by_name().items()
            if g.grad is not None}


def _distance(ref: tuple[list[float], dict], got: tuple[list[float], dict]) -> tuple[float, float, str]:
    """(worst first-step gradient error as _grad_errors measures it, worst loss difference, the worst parameter)."""
    errors = _grad_errors(ref[1], got[1])
    name, grad = max(errors, key=lambda e: e[1], default=("", 0.0))
    loss = max((abs(a - b) for a, b in zip(ref[0], got[0])), default=0.0)
    return grad, loss, name


def bf16_floor(master: nn.Module, batches: list, make_opt: Callable[[Any], Any],
               fp32_ref: tuple[list[float], dict]) -> tuple[float, float, str]:
    """How far rounding alone moves plain PyTorch's bf16 run: its distance from the FP32 run of the same scheme
    (same masters, batches and steps). Returns (gradient floor, loss floor, a line saying so).

    Eager against SDPA attention in bf16 was measured as the other candidate and rejected: on Llama it differs by
    0.72 (relative, one gradient), on Qwen3-MoE by 1.0, so 4x it would pass anything; and it is zero for models
    without attention (Mamba)."""
    bf16 = train_plain(master, batches, torch.bfloat16, make_opt)
    grad, loss, _ = _distance(fp32_ref, bf16)
    return grad, loss, f"bf16 vs FP32 reference {grad:.1e} / {loss:.1e}"


def _plain_failure(arch: str, tried: list[tuple[str, BaseException]]) -> Verdict:
    first_what, first_exc = tried[0]
    if len(tried) == 1:
        what = f"({first_what})"
    else:
        what = "at every size the probe tries (" + "; ".join(
            f"{w}: {type(e).__name__}: {e}" for w, e in tried[1:]) + ")"
    if isinstance(first_exc, _BuildFailure):
        return Verdict("crashed", f"could not build a small {arch}: {first_exc}"
                       + (f"; nor {what}" if len(tried) > 1 else ""), arch)
    return Verdict("crashed", f"plain transformers fails to train the small {arch} {what}: "
                   f"{type(first_exc).__name__}: {first_exc}", arch)


class _BuildFailure(Exception):
    pass


def run_probe(model_cls: type, config: Any, engine_factory: Callable[..., Any],
              engine_config: Any | None = None) -> Verdict:
    """Build a tiny `model_cls` of `config`'s structure and compare PyTorch and the engine on it.

    FP32 always (the strict check, GRAD_RTOL / LOSS_ATOL); when `engine_config` computes in bf16, also the engine in
    that dtype and host mode against plain PyTorch's bf16 scheme, within BF16_FLOOR_FACTOR x the reference's own
    bf16 floor (`bf16_floor`). A config plain transformers cannot train when shrunk is shrunk less (`_shrinks`)."""
    arch = model_cls.__name__
    mode = _Mode.of(engine_config)
    tried: list[tuple[str, BaseException]] = []
    first: nn.Module | None = None
    with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):  # the caller's CPU stream left as it was
        warnings.simplefilter("ignore")
        for what, shrink, cap in _shrinks(config):
            try:
                tiny = shrink(config)
                master = _build(model_cls, tiny, config, cap)
                master.float().train()
                first = first or master
            except _MissingPackage as exc:
                return Verdict("crashed", str(exc), arch)
            except Exception as exc:  # noqa: BLE001 - any failure to build is reported, never swallowed silently
                tried.append((what, _BuildFailure(f"{type(exc).__name__}: {exc}")))
                if "cannot build its default config either" in str(exc):
                    break  # not the shrinking: transformers cannot build this config at all
                continue
            max_pos = vars(tiny).get("max_position_embeddings")
            seq = min(_SEQ, max_pos) if isinstance(max_pos, int) and max_pos > 0 else _SEQ
            # Padded batches first; where plain transformers trains the model only without padding (DeepSeek-V3's
            # latent attention with grouped key/value heads fails on any mask), unpadded ones prove that much.
            for pad in (True, False):
                batches = _batches(STEPS, vars(tiny).get("vocab_size") or _VOCAB, seq, pad=pad)
                try:
                    ref = train_plain(master, batches, torch.float32, _optimizer(mode, False))
                except Exception as exc:  # noqa: BLE001
                    tried.append((what + ("" if pad else ", unpadded batches"), exc))
                    continue
                return _compare(master, batches, ref, engine_factory, mode, arch)
        refusal = _engine_refusal(first, engine_factory, arch) if first is not None else _own_refusal(
            model_cls, config, arch)
    return refusal or _plain_failure(arch, tried)


def _own_refusal(model_cls: type, config: Any, arch: str) -> Verdict | None:
    """The engine's refusal by name of the user's own config, built on the meta device, when no shrink of it builds
    (a shrink that breaks a rule the user's config keeps, e.g. which layers share keys and values): the reason the
    engine would give the real model, rather than the probe's failure to build a small one."""
    from ...models.adapter import find_parts

    try:
        model = _instantiate(model_cls, copy.deepcopy(config), meta=True)
    except Exception:  # noqa: BLE001 - transformers cannot build it: _plain_failure says so
        return None
    try:
        find_parts(model)
    except ValueError as exc:
        return Verdict("refused", str(exc), arch)
    return None


def _engine_refusal(master: nn.Module, engine_factory: Callable[..., Any], arch: str) -> Verdict | None:
    """The engine's own refusal by name of a model plain transformers cannot train either: the more useful reason
    (e.g. no decoder layer stack), or None when the engine takes it."""
    try:
        _train_engine(master, [], engine_factory, _Mode(), _optimizer(_Mode(), False), arch)
    except _EngineFailure as failure:
        return failure.verdict if failure.verdict.status == "refused" else None
    return None


def _compare(master: nn.Module, batches: list, ref: tuple[list[float], dict], engine_factory: Callable[..., Any],
             mode: _Mode, arch: str) -> Verdict:
    try:
        got = _train_engine(master, batches, engine_factory, _Mode(), _optimizer(mode, False), arch)
    except _EngineFailure as failure:
        return failure.verdict
    errors = _grad_errors(ref[1], got[1])
    worst_grad = max((e for _, e in errors), default=0.0)
    bad = next(((n, e) for n, e in errors if not e <= GRAD_RTOL), None)
    if bad is not None:
        return Verdict("mismatch", f"the gradient of {bad[0]} differs from PyTorch's by {bad[1]:.2e} "
                       f"(relative; tolerance {GRAD_RTOL:g})", arch, worst_grad)
    worst_loss = 0.0
    for step, (a, b) in enumerate(zip(ref[0], got[0])):
        worst_loss = max(worst_loss, abs(a - b))
        if not abs(a - b) <= LOSS_ATOL:
            return Verdict("mismatch", f"the loss of step {step} differs from PyTorch's by {abs(a - b):.2e} "
                           f"(tolerance {LOSS_ATOL:g}); first-step gradients agreed", arch, worst_grad, abs(a - b))
    if not mode.bf16:
        return Verdict("exact", "", arch, worst_grad, worst_loss)
    return _compare_bf16(master, batches, engine_factory, mode, arch)


def _compare_bf16(master: nn.Module, batches: list, engine_factory: Callable[..., Any], mode: _Mode,
                  arch: str) -> Verdict:
    make_opt = _optimizer(mode, True)
    fp32 = train_plain(master, batches, torch.float32, make_opt)
    try:
        ref = train_plain(master, batches, torch.bfloat16, make_opt)
    except Exception as exc:  # noqa: BLE001
        return Verdict("crashed", f"plain PyTorch fails to train the small {arch} in bf16 compute with FP32 masters:"
                       f" {type(exc).__name__}: {exc} (the engine's cast points: parameters in bf16, buffers as the"
                       " model holds them); train it with compute_dtype='float32'", arch)
    try:
        got = _train_engine(master, batches, engine_factory, mode, make_opt, arch)
    except _EngineFailure as failure:
        return failure.verdict
    floor_grad, floor_loss, how = bf16_floor(master, batches, make_opt, fp32)
    tol_grad = BF16_FLOOR_FACTOR * max(floor_grad, BF16_MIN_FLOOR)
    tol_loss = BF16_FLOOR_FACTOR * max(floor_loss, BF16_MIN_FLOOR)
    grad, loss, name = _distance(ref, got)
    if not grad <= tol_grad:
        return Verdict("mismatch", f"in bf16 ({mode.host_master} master) the gradient of {name} differs from plain "
                       f"PyTorch's bf16 scheme by {grad:.2e} (relative; tolerance {tol_grad:.1e} = "
                       f"{BF16_FLOOR_FACTOR:g} x the reference's bf16 floor: {how})", arch, grad)
    if not loss <= tol_loss:
        return Verdict("mismatch", f"in bf16 ({mode.host_master} master) a loss differs from plain PyTorch's bf16 "
                       f"scheme by {loss:.2e} (tolerance {tol_loss:.1e} = {BF16_FLOOR_FACTOR:g} x the reference's "
                       f"bf16 floor: {how})", arch, grad, loss)
    return Verdict("exact", "", arch, grad, loss)


_MEMO: dict[str, Verdict] = {}


def verify_model(model: nn.Module, engine_factory: Callable[..., Any], engine_config: Any | None = None) -> Verdict:
    """Run (or recall) the probe for `model`'s architecture in `engine_config`'s compute dtype and host modes (None:
    FP32); raise `ModelMismatchError` unless it is exact."""
    model_cls, config = type(model), model.config
    key = cache_key(model_cls, config, engine_config)
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
            verdict = run_probe(model_cls, config, engine_factory, engine_config)
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
