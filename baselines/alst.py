"""DeepSpeed ZeRO-3 CPU offload set up for long sequences the way DeepSpeed's ALST pieces are meant to be used.

Arctic Long Sequence Training (ALST) ships in DeepSpeed as three single-GPU pieces besides Ulysses
sequence parallelism (which needs several GPUs and is not used here):

- `TiledFusedLogitsLoss` (deepspeed.runtime.sequence_parallel.ulysses_sp): LM head + cross-entropy
  over sequence tiles, so the full `tokens x vocab` logits never exist;
- `TiledMLP` (same module): each decoder layer's MLP run over sequence tiles and recomputed in
  backward, so its `tokens x intermediate` activations exist for one tile at a time;
- DeepSpeed activation checkpointing with `cpu_checkpointing`, so each layer's checkpointed input
  waits for backward in host memory instead of on the device.

Each is wired in as DeepSpeed's own docstrings show (the MLP's `forward` replaced by one that calls
`TiledMLP.apply`; the loss computed by `TiledFusedLogitsLoss.apply` over the final hidden states;
`deepspeed.checkpointing.configure(deepspeed_config=...)` then `deepspeed.checkpointing.checkpoint`
as the model's checkpoint function). Everything else is the `zero3` backend unchanged.

Options come from an `alst` section of the DeepSpeed-style config (removed before DeepSpeed sees it):
`mlp_tile_tokens` (default: the hidden size, DeepSpeed's example `ceil(seqlen / hidden)` shards) and
`loss_tile_tokens` (default: as many tokens as keep one tile's FP32 logits at 64 MiB).
"""

from __future__ import annotations

import contextlib
import math
import types
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from baselines.zero3 import Zero3Backend, require_deepspeed

NAME = "zero3-alst"
_LOSS_TILE_LOGIT_BYTES = 64 * 2**20
_OPTIONS = ("mlp_tile_tokens", "loss_tile_tokens")
# DeepSpeed's checkpoint offload as its config documents it; partitioning is for tensor parallelism.
ACTIVATION_CHECKPOINTING = {"partition_activations": False, "cpu_checkpointing": True,
                            "contiguous_memory_optimization": False, "synchronize_checkpoint_boundary": False}


# What the host side of a checkpoint copy is allocated under; a harness that accounts device memory on
# a CPU-only machine sets it to tell host copies from device tensors (both live in the same RAM there).
_host_copy_context: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext


def set_host_copy_context(factory: Callable[[], AbstractContextManager[Any]]) -> None:
    """Allocate the host copies of offloaded checkpoints inside `factory()` (CPU-only machines)."""
    global _host_copy_context
    _host_copy_context = factory


def make_cpu_checkpointing_copy() -> bool:
    """On a machine without an accelerator, make DeepSpeed's `cpu_checkpointing` copies real copies.

    DeepSpeed keeps a checkpoint on the host with `copy_to_device(x, torch.device("cpu"))` and then
    empties `x`'s device storage. With the device being the CPU that "copy" is `x` itself, so the
    checkpoint is emptied and the recompute fails (measured: "Dimension out of range" in backward).
    Here the host copy is a clone (allocated under the host-copy context) and the restore in backward
    (`move_to_device(saved, device_name)`) a clone too, which is what the two copies are on a GPU.
    Returns whether anything was changed. Idempotent.
    """
    if torch.accelerator.current_accelerator(check_available=True) is not None:
        return False
    from deepspeed.runtime.activation_checkpointing import checkpointing as ckpt

    if getattr(ckpt.copy_to_device, "_host_copy", False):
        return True
    ds_copy, ds_move = ckpt.copy_to_device, ckpt.move_to_device

    def copy_to_device(item: Any, device: Any, criterion_func: Callable[[Any], bool]) -> Any:
        # DeepSpeed names the host as torch.device("cpu") and the compute device by its name (a str).
        if not (isinstance(device, torch.device) and device.type == "cpu" and isinstance(item, (list, tuple))):
            return ds_copy(item, device, criterion_func)
        with _host_copy_context():
            return type(item)(t.clone() if criterion_func(t) else ds_copy(t, device, criterion_func) for t in item)

    def move_to_device(item: Any, device: Any, criterion_func: Callable[[Any], bool] | None = None) -> Any:
        if not (isinstance(device, str) and criterion_func is not None and isinstance(item, (list, tuple))):
            return ds_move(item, device, criterion_func)
        for t in item:
            if criterion_func(t):
                t.data = t.data.clone()
        return item

    copy_to_device._host_copy = True
    ckpt.copy_to_device, ckpt.move_to_device = copy_to_device, move_to_device
    return True


def split_alst_options(config: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, int | None]]:
    """The DeepSpeed config without its `alst` section, and that section's checked options."""
    cfg = dict(config or {})
    section = cfg.pop("alst", None) or {}
    if not isinstance(section, dict):
        raise TypeError(f'backend "{NAME}": the config\'s "alst" section must be a dict, not {type(section).__name__}')
    unknown = sorted(set(section) - set(_OPTIONS))
    if unknown:
        raise ValueError(f'backend "{NAME}": unknown "alst" option(s) {unknown}; known: {list(_OPTIONS)}')
    opts: dict[str, int | None] = {}
    for key in _OPTIONS:
        v = section.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f'backend "{NAME}": alst.{key} must be a positive int, not {v!r}')
        opts[key] = v
    ac = cfg.setdefault("activation_checkpointing", {})
    for key, want in ACTIVATION_CHECKPOINTING.items():
        ac.setdefault(key, want)
    return cfg, opts


def _shards(tokens: int, tile: int) -> int:
    return max(1, math.ceil(tokens / tile))


def _decoder_mlps(model: torch.nn.Module) -> list[torch.nn.Module]:
    mlps = [m.mlp for m in model.modules() if hasattr(m, "mlp") and hasattr(m, "self_attn")]
    for mlp in mlps:
        if not all(hasattr(mlp, k) for k in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            raise TypeError(f'backend "{NAME}" tiles gated MLPs (gate/up/down projections); '
                            f"{type(mlp).__name__} is not one")
    if not mlps:
        raise TypeError(f'backend "{NAME}" found no decoder layers (modules with self_attn and mlp) in '
                        f"{type(model).__name__}")
    return mlps


def _gated_mlp(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def tile_mlps(model: torch.nn.Module, tile_tokens: int | None) -> int:
    """Route every decoder layer's MLP through DeepSpeed's `TiledMLP`; returns how many were patched.

    Patched per instance (not per class, as DeepSpeed's example does) so other models in the process
    are untouched. The tile is in tokens; DeepSpeed's example uses one of `hidden` tokens.
    """
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    mlps = _decoder_mlps(model)

    def tiled_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        tile = tile_tokens or x.shape[-1]
        params = [self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight]
        params += [p for p in (self.gate_proj.bias, self.up_proj.bias, self.down_proj.bias) if p is not None]
        return TiledMLP.apply(_gated_mlp, self, x, _shards(x.shape[-2], tile), params)

    for mlp in mlps:
        mlp.forward = types.MethodType(tiled_forward, mlp)
    return len(mlps)


def tile_loss(model: torch.nn.Module, tile_tokens: int | None) -> None:
    """Make `model(input_ids=..., labels=...)` compute HF's causal-LM loss with `TiledFusedLogitsLoss`.

    HF's loss is the mean over the shifted labels that are not -100. `TiledFusedLogitsLoss` backprops
    each tile inside its forward with gradient 1/shards ("mean"), so each tile returns its summed loss
    times shards / (valid labels): the mean over tiles is then exactly HF's mean, the unequal last tile
    and ignored labels included. Without labels the model runs as before (full logits).
    """
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    for attr in ("model", "lm_head", "config"):
        if not hasattr(model, attr):
            raise TypeError(f'backend "{NAME}" needs a *ForCausalLM model with .model and .lm_head, '
                            f"not {type(model).__name__}")
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(cfg, "final_logit_softcapping", None):
        raise TypeError(f'backend "{NAME}": the tiled loss has no final-logit softcapping')
    vocab = cfg.vocab_size
    tile = tile_tokens or max(1, _LOSS_TILE_LOGIT_BYTES // (4 * vocab))
    full_forward = model.forward
    embedding = model.get_input_embeddings()
    tied = [p for p in model.lm_head.parameters() if any(p is q for q in embedding.parameters())]

    def forward(self: torch.nn.Module, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                **kwargs: Any) -> Any:
        if labels is None:
            return full_forward(input_ids=input_ids, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state
        shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
        valid = int((shift != -100).sum())
        shards = _shards(shift.numel(), tile)
        scale = shards / max(valid, 1)

        def loss_fn(head: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            # A head tied to the embedding gets a second gradient in backward; ZeRO-3 must reduce the
            # sum once (two entries of one parameter in its reduce bucket fail an assertion), so the
            # last tile's "ready" mark is withdrawn here and given back once the loss is done.
            for p in tied:
                p.ds_grad_is_ready = False
            logits = head(x).float()
            return torch.nn.functional.cross_entropy(logits, y, ignore_index=-100, reduction="sum") * scale

        loss = TiledFusedLogitsLoss.apply(loss_fn, self.lm_head, hidden, shift, None, shards,
                                          list(self.lm_head.parameters()), "mean")
        for p in tied:
            p.ds_grad_is_ready = True
        return CausalLMOutputWithPast(loss=loss)

    model.forward = types.MethodType(forward, model)


class Zero3AlstBackend(Zero3Backend):
    """The `zero3` backend with DeepSpeed's ALST tiling and host-offloaded activation checkpoints.

    `TiledFusedLogitsLoss` computes the LM head's gradient inside the forward, for a loss that is then
    backpropagated with gradient 1; a loss scaled afterwards (gradient accumulation divides it) would
    scale the rest of the model but not the head, so accumulation is refused rather than trained wrong.
    Activation checkpointing is always on (the host offload acts on its checkpoints), whatever the
    Accelerator's `gradient_checkpointing` says.
    """

    name = NAME

    def __init__(self, *, config: dict[str, Any] | None = None, gradient_accumulation_steps: int = 1,
                 gradient_checkpointing: bool = True, **kwargs: Any) -> None:
        if config is not None and not isinstance(config, dict):
            raise TypeError(f'backend "{NAME}" takes a DeepSpeed config dict, not {type(config).__name__}')
        if gradient_accumulation_steps != 1:
            raise ValueError(f'backend "{NAME}": TiledFusedLogitsLoss computes the LM head\'s gradient in the '
                             "forward for an unscaled loss, so gradient accumulation (which scales it) would train "
                             "the head wrong; use gradient_accumulation_steps=1")
        ds_config, self.alst_options = split_alst_options(config)
        # Checkpointing is what the host offload acts on: always on for this backend.
        super().__init__(config=ds_config, gradient_accumulation_steps=1, gradient_checkpointing=False, **kwargs)

    def prepare(self, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None, *,
                micro_batch_size: int | None = None) -> tuple[Any, torch.optim.Optimizer | None]:
        if model is not None and self.engine is None:
            deepspeed = require_deepspeed()
            tile_mlps(model, self.alst_options["mlp_tile_tokens"])
            tile_loss(model, self.alst_options["loss_tile_tokens"])
            engine, opt = super().prepare(model, optimizer, micro_batch_size=micro_batch_size)
            # DeepSpeed reads its activation-checkpointing section only when asked to (Megatron-style).
            deepspeed.checkpointing.configure(None, deepspeed_config=self.ds_config)
            make_cpu_checkpointing_copy()
            model.gradient_checkpointing_enable()
            model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=deepspeed.checkpointing.checkpoint)
            return engine, opt
        return super().prepare(model, optimizer, micro_batch_size=micro_batch_size)
