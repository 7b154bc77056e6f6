"""DeepSpeed JSON configs, parsed and checked up front into one typed object.

Everything that can be wrong with a config is reported here, before a model is touched: a typo in a
key (with the close spelling suggested), a value of the wrong type, batch sizes that do not multiply
out, a negative learning rate, fp16. Settings DeepSpeed has but MegaTrain has no use for (bucket
sizes, communication options, ...) are accepted and named together in a single warning, so an
existing DeepSpeed config runs unchanged and nobody is surprised that they did nothing.

Batch sizes resolve exactly as DeepSpeed does for the job's data-parallel world size (the missing one of
train_batch_size / train_micro_batch_size_per_gpu / gradient_accumulation_steps is derived from the
other two). `"auto"` values, which raw DeepSpeed rejects, are resolved the way Hugging Face's
integration resolves them: from a TrainingArguments-like `args` when one is given, from the other
values where they determine it, and otherwise with an error that says what to write instead.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..lr_schedules import SCHEDULES, WARMUP_TYPES
from .schema import AUTO, EngineConfig
from .settings import FACE_KEYS, bf16_enabled, bf16_section, clipping, from_args
from .validate import check_keys, close_match, is_bool, is_int, is_number

__all__ = ["DeepSpeedConfig", "OptimizerSpec", "SchedulerSpec", "ZeroSpec", "parse_config", "load_config_dict"]


# Top-level keys MegaTrain acts on: the ones a face reads itself (megatrain/config/settings.py) and these.
_HONOURED = (
    *FACE_KEYS, "optimizer", "scheduler", "fp16", "zero_optimization", "steps_per_print",
    "wall_clock_breakdown", "dataloader_drop_last", "megatrain", "amp", "torch_autocast",
    "managed_gradient_accumulation",
)
# Top-level keys DeepSpeed knows that mean nothing for one process streaming layers from host memory.
_NO_MEANING = (
    "activation_checkpointing", "aio", "autotuning", "checkpoint", "comms_logger", "communication_data_type",
    "compile", "compression_training", "comet", "csv_monitor", "curriculum_learning", "data_efficiency",
    "data_types", "datastates", "disable_allgather", "disable_python_gc", "dump_state", "eigenvalue", "elasticity",
    "expert_parallel", "flops_profiler", "gradient_allreduce_op", "gradient_predivide_factor", "hybrid_engine",
    "log_level", "memory_breakdown", "monitor_config", "nebula", "pipeline", "prescale_gradients",
    "progressive_layer_drop", "quantize_training", "seq_parallel_communication_data_type", "sequence_parallel_size",
    "sparse_attention", "sparse_gradients", "tensor_parallel", "tensorboard", "timers",
    "use_data_before_expert_parallelism", "vocabulary_size", "wandb", "weight_quantization",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
)
_TOP_LEVEL = frozenset(_HONOURED + _NO_MEANING)
# Keys accelerate and transformers write into every config they hand on (to let DeepSpeed take an optimizer it has
# not tested): the user never wrote them, so they are accepted without being named as ignored.
_ADDED_BY_TRAINERS = frozenset({"zero_allow_untested_optimizer"})

# DeepSpeedZeroConfig's fields and aliases (deepspeed 0.19); all accepted, none changes what MegaTrain does
# except the offload sections' pin_memory.
_ZERO_KEYS = frozenset((
    "stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size", "use_multi_rank_bucket_allreduce",
    "allgather_partitions", "allgather_bucket_size", "overlap_comm", "compute_grad_norm", "load_from_fp32_weights",
    "elastic_checkpoint", "offload_param", "offload_optimizer", "zenflow", "sub_group_size", "cpu_offload_param",
    "cpu_offload_use_pin_memory", "cpu_offload", "prefetch_bucket_size", "stage3_prefetch_bucket_size",
    "param_persistence_threshold", "stage3_param_persistence_threshold", "model_persistence_threshold",
    "stage3_model_persistence_threshold", "max_live_parameters", "stage3_max_live_parameters", "max_reuse_distance",
    "stage3_max_reuse_distance", "gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save", "module_granularity_threshold",
    "stage3_module_granularity_threshold", "use_all_reduce_for_fetch_params",
    "stage3_use_all_reduce_for_fetch_params", "allgather_sequential", "stage3_allgather_sequential",
    "ignore_unused_parameters", "legacy_stage1", "round_robin_gradients", "parameter_alignment",
    "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_nontrainable_weights",
    "zero_quantized_gradients", "memory_efficient_linear", "pipeline_loading_checkpoint", "override_module_apply",
    "log_trace_cache_warnings", "enable_sanity_checks", "save_muon_momentum_buffer_in_memory", "leaf_module",
    "mics_shard_size", "mics_hierarchical_params_gather",
))
_OFFLOAD_KEYS = {
    "offload_param": frozenset(("device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory")),
    "offload_optimizer": frozenset((
        "device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read", "pipeline_write", "fast_init", "ratio",
        "super_offload", "cpuadam_cores_perc", "pipeline",
    )),
}
_OFFLOAD_DEVICES = ("none", "cpu", "nvme")  # nvme: the optimizer state only (the NVMe tier)

_ADAM_TYPES = {"adam": "Adam", "adamw": "AdamW"}
_ADAM_PARAMS = frozenset((
    "lr", "betas", "eps", "weight_decay", "bias_correction", "amsgrad", "adam_w_mode", "torch_adam",
    "fp32_optimizer_states",
))
_BF16_KEYS = frozenset(("enabled", "immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads"))
_FP16_KEYS = frozenset((
    "enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
    "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads",
))


class DeepSpeedConfigError(ValueError):
    """A DeepSpeed config MegaTrain cannot run; the message names the key."""


# ---------------------------------------------------------------------------------------------------
# typed result


@dataclass(frozen=True)
class OptimizerSpec:
    """The `optimizer` section: Adam-family hyper-parameters, DeepSpeed's defaults."""

    type: str = "AdamW"  # "AdamW", or "Adam" with adam_w_mode=False for L2-style weight decay
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0  # DeepSpeed's default (torch.optim.AdamW's is 0.01)
    amsgrad: bool = False
    adam_w_mode: bool = True
    # "SGD" (DeepSpeed hands its params to torch.optim.SGD; so does MegaTrain)
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False

    def build(self, params: Iterable[Any]) -> torch.optim.Optimizer:
        """The torch optimizer these settings describe, over `params` (tensors or param groups)."""
        if self.type == "SGD":
            return torch.optim.SGD(list(params), lr=self.lr, momentum=self.momentum, dampening=self.dampening,
                                   weight_decay=self.weight_decay, nesterov=self.nesterov)
        cls = torch.optim.AdamW if self.adam_w_mode else torch.optim.Adam
        # Masters always live in host memory as FP32, where torch's fused CPU kernel applies.
        return cls(list(params), lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay,
                   amsgrad=self.amsgrad, fused=True)


@dataclass(frozen=True)
class SchedulerSpec:
    """The `scheduler` section: a DeepSpeed warm-up schedule (or a torch.optim.lr_scheduler class by name)."""

    type: str
    params: dict[str, Any] = field(default_factory=dict)

    def build(self, optimizer: torch.optim.Optimizer) -> Any:
        if self.type in SCHEDULES:
            return SCHEDULES[self.type](optimizer, **self.params)
        return getattr(torch.optim.lr_scheduler, self.type)(optimizer, **self.params)


@dataclass(frozen=True)
class ZeroSpec:
    stage: int = 0
    offload_param_device: str = "none"
    offload_optimizer_device: str = "none"
    pin_memory: bool | None = None  # from the offload sections, when either says
    nvme_path: str | None = None  # offload_optimizer on NVMe: the engine's NVMe tier (nvme_path)


@dataclass(frozen=True)
class DeepSpeedConfig:
    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    gradient_clipping: float
    optimizer: OptimizerSpec | None
    scheduler: SchedulerSpec | None
    bf16: bool
    zero: ZeroSpec
    steps_per_print: int | None
    wall_clock_breakdown: bool
    dataloader_drop_last: bool
    engine: EngineConfig
    ignored: tuple[str, ...]  # dotted keys that were accepted but have no effect
    resolved: dict[str, Any]  # the input with "auto" values replaced (what a checkpoint records)


# ---------------------------------------------------------------------------------------------------
# small checkers


def _err(msg: str) -> DeepSpeedConfigError:
    return DeepSpeedConfigError(f"DeepSpeed config: {msg}")


def _unknown(where: str) -> Callable[[Any, str | None], DeepSpeedConfigError]:
    def refuse(key: Any, close: str | None) -> DeepSpeedConfigError:
        hint = f"; did you mean {close!r}?" if close else ""
        return _err(f"unknown key {where}{key!r}{hint}")

    return refuse


def _check_keys(d: dict[str, Any], known: Iterable[str], where: str) -> None:
    check_keys(d, known, _unknown(where))


def _section(d: dict[str, Any], key: str, where: str = "") -> dict[str, Any]:
    v = d.get(key)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise _err(f"{where}{key!r} must be an object (a JSON dict), got {type(v).__name__} {v!r}")
    return v


def _int(v: Any, name: str, minimum: int | None = None) -> int:
    if not is_int(v):
        raise _err(f"{name!r} must be an integer, got {type(v).__name__} {v!r}")
    if minimum is not None and v < minimum:
        raise _err(f"{name!r} must be >= {minimum}, got {v}")
    return v


def _float(v: Any, name: str, minimum: float | None = None) -> float:
    if not is_number(v) or not math.isfinite(v):
        raise _err(f"{name!r} must be a finite number, got {type(v).__name__} {v!r}")
    if minimum is not None and v < minimum:
        raise _err(f"{name!r} must be >= {minimum}, got {v}")
    return float(v)


# Adam moves every weight by about lr each step: past 1 the weights outgrow their own scale at once and
# reach inf within steps (a fuzzed lr of 3.4e37 did in one). No working recipe comes near it.
MAX_ADAM_LR = 1.0
_FP32_TINY = torch.finfo(torch.float32).tiny


def _lr(v: Any, name: str) -> float:
    lr = _float(v, name, minimum=0.0)
    if lr > MAX_ADAM_LR:
        raise _err(f"{name!r} = {v} is far beyond what Adam trains with (each step moves every weight by about "
                   f"lr); use a value <= {MAX_ADAM_LR:g}, typically 1e-5 to 1e-3")
    return lr


def _bool(v: Any, name: str) -> bool:
    if not is_bool(v):
        raise _err(f"{name!r} must be true or false, got {type(v).__name__} {v!r}")
    return v


def _from_args(args: Any, attr: str, name: str, hint: str) -> Any:
    return from_args(args, attr, name, hint, _err)


# ---------------------------------------------------------------------------------------------------
# sections


def _batch_sizes(d: dict[str, Any], args: Any, world: int = 1) -> tuple[int, int, int]:
    names = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    from_args = {"train_micro_batch_size_per_gpu": "per_device_train_batch_size",
                 "gradient_accumulation_steps": "gradient_accumulation_steps"}
    vals: dict[str, int | None] = {}
    for n in names:
        v = d.get(n)
        if v == AUTO:
            attr = from_args.get(n)
            v = getattr(args, attr, None) if attr and args is not None else None
        vals[n] = None if v is None else _int(v, n, minimum=1)
    tb, mb, ga = (vals[n] for n in names)
    # DeepSpeed's derivation (deepspeed.runtime.config's _set_batch_related_parameters): tb = mb x ga x world.
    if tb is not None and mb is not None and ga is None:
        ga = tb // mb // world
    elif tb is not None and ga is not None and mb is None:
        mb = tb // ga // world
    elif mb is not None and ga is not None and tb is None:
        tb = mb * ga * world
    elif tb is not None and mb is None and ga is None:
        mb, ga = tb // world, 1
    elif mb is not None and tb is None and ga is None:
        tb, ga = mb * world, 1
    elif tb is None and mb is None:
        raise _err("either 'train_batch_size' or 'train_micro_batch_size_per_gpu' must be given")
    if ga < 1 or mb < 1:
        raise _err(f"train_batch_size={tb} cannot be split: it derives micro batch {mb} x accumulation {ga}")
    if tb != mb * ga * world:
        raise _err(f"train_batch_size ({tb}) must equal train_micro_batch_size_per_gpu ({mb}) x "
                   f"gradient_accumulation_steps ({ga}) x world size ({world}) = {mb * ga * world}")
    return tb, mb, ga


def _optimizer(d: dict[str, Any], args: Any) -> OptimizerSpec | None:
    sec = _section(d, "optimizer")
    if not sec:
        return None
    _check_keys(sec, ("type", "params", "legacy_fusion"), "optimizer.")
    name = sec.get("type")
    if not isinstance(name, str):
        raise _err(f"'optimizer.type' must be a string such as \"AdamW\", got {name!r}")
    if name.lower() == "sgd":
        return _sgd(dict(_section(sec, "params", "optimizer.")), args)
    if name.lower() not in _ADAM_TYPES:
        raise _err(f"optimizer type {name!r} is not supported by MegaTrain; use \"AdamW\", \"Adam\" or \"SGD\" "
                   "(or pass your own torch optimizer to initialize())")
    kind = _ADAM_TYPES[name.lower()]
    p = dict(_section(sec, "params", "optimizer."))
    if "max_grad_norm" in p:
        raise _err("'optimizer.params.max_grad_norm' is not an optimizer parameter; use the top-level "
                   "'gradient_clipping' instead")
    _check_keys(p, _ADAM_PARAMS, "optimizer.params.")
    auto = {
        "lr": lambda: _from_args(args, "learning_rate", "optimizer.params.lr", "write the learning rate"),
        "betas": lambda: [_from_args(args, "adam_beta1", "optimizer.params.betas", "write [beta1, beta2]"),
                          _from_args(args, "adam_beta2", "optimizer.params.betas", "write [beta1, beta2]")],
        "eps": lambda: _from_args(args, "adam_epsilon", "optimizer.params.eps", "write e.g. 1e-8"),
        "weight_decay": lambda: _from_args(args, "weight_decay", "optimizer.params.weight_decay", "write e.g. 0.0"),
    }
    for k, fill in auto.items():
        if p.get(k) == AUTO:
            p[k] = fill()
    out: dict[str, Any] = {"type": kind}
    if "lr" in p:
        out["lr"] = _lr(p["lr"], "optimizer.params.lr")
    if "betas" in p:
        b = p["betas"]
        if not isinstance(b, (list, tuple)) or len(b) != 2 or not all(is_number(x) and 0.0 <= x < 1.0 for x in b):
            raise _err(f"'optimizer.params.betas' must be two numbers in [0, 1), got {b!r}")
        out["betas"] = (float(b[0]), float(b[1]))
    if "eps" in p:
        out["eps"] = _float(p["eps"], "optimizer.params.eps", minimum=0.0)
        if out["eps"] < _FP32_TINY:
            # v is exactly 0 wherever a gradient has always been 0 (embedding rows of unseen tokens), and an
            # eps this small is 0 in the FP32 the optimizer computes in: 0/0.
            raise _err(f"'optimizer.params.eps' = {p['eps']} is 0 in FP32 and divides 0 by 0 for every weight whose "
                       "gradient has been 0 so far (e.g. embedding rows of tokens not yet seen); use e.g. 1e-8")
    if "weight_decay" in p:
        out["weight_decay"] = _float(p["weight_decay"], "optimizer.params.weight_decay", minimum=0.0)
    if "amsgrad" in p:
        out["amsgrad"] = _bool(p["amsgrad"], "optimizer.params.amsgrad")
    if "bias_correction" in p and not _bool(p["bias_correction"], "optimizer.params.bias_correction"):
        raise _err("'optimizer.params.bias_correction': false is not supported (torch's Adam always corrects)")
    for k in ("torch_adam", "fp32_optimizer_states"):
        if k in p:
            _bool(p[k], f"optimizer.params.{k}")
    # As in DeepSpeed: "AdamW" is always decoupled; "Adam" is too unless adam_w_mode is false.
    w_mode = True if "adam_w_mode" not in p else _bool(p["adam_w_mode"], "optimizer.params.adam_w_mode")
    out["adam_w_mode"] = kind == "AdamW" or w_mode
    lr, wd = out.get("lr", OptimizerSpec.lr), out.get("weight_decay", OptimizerSpec.weight_decay)
    if out["adam_w_mode"] and lr * wd > 1.0:
        # Decoupled decay multiplies every weight by (1 - lr x wd) each step: past 1 the weights flip sign,
        # past 2 they grow without bound. (As an L2 term in Adam it is normalized away: no such limit.)
        raise _err(f"'optimizer.params.weight_decay' = {p['weight_decay']} with lr {lr:g} multiplies every weight "
                   f"by (1 - lr x weight_decay) = {1 - lr * wd:.3g} each step; keep lr x weight_decay <= 1 "
                   "(typical weight_decay: 0 to 0.1)")
    return OptimizerSpec(**out)


def _sgd(p: dict[str, Any], args: Any) -> OptimizerSpec:
    _check_keys(p, ("lr", "momentum", "dampening", "weight_decay", "nesterov"), "optimizer.params.")
    if p.get("lr") == AUTO:
        p["lr"] = _from_args(args, "learning_rate", "optimizer.params.lr", "write the learning rate")
    if p.get("weight_decay") == AUTO:
        p["weight_decay"] = _from_args(args, "weight_decay", "optimizer.params.weight_decay", "write e.g. 0.0")
    if "lr" not in p:
        raise _err("SGD needs 'optimizer.params.lr' (torch.optim.SGD has no default learning rate)")
    out: dict[str, Any] = {"type": "SGD", "lr": _lr(p["lr"], "optimizer.params.lr")}
    for k in ("momentum", "dampening", "weight_decay"):
        if k in p:
            out[k] = _float(p[k], f"optimizer.params.{k}", minimum=0.0)
    if "nesterov" in p:
        out["nesterov"] = _bool(p["nesterov"], "optimizer.params.nesterov")
        if out["nesterov"] and (out.get("momentum", 0.0) <= 0 or out.get("dampening", 0.0) != 0):
            raise _err("'optimizer.params.nesterov': true needs momentum > 0 and dampening 0 (as torch.optim.SGD)")
    return OptimizerSpec(**out)


def _scheduler_signature(kind: str) -> inspect.Signature:
    cls = SCHEDULES.get(kind) or getattr(torch.optim.lr_scheduler, kind)
    return inspect.signature(cls.__init__)


def _scheduler(d: dict[str, Any], opt: OptimizerSpec | None, args: Any) -> SchedulerSpec | None:
    sec = _section(d, "scheduler")
    if not sec:
        return None
    _check_keys(sec, ("type", "params"), "scheduler.")
    kind = sec.get("type")
    torch_kinds = [n for n, c in vars(torch.optim.lr_scheduler).items()
                   if isinstance(c, type) and issubclass(c, torch.optim.lr_scheduler.LRScheduler) and n[0] != "_"]
    if not isinstance(kind, str) or (kind not in SCHEDULES and kind not in torch_kinds):
        close = close_match(kind, SCHEDULES)
        hint = f"; did you mean {close!r}?" if close else ""
        raise _err(f"scheduler type {kind!r} is not supported{hint} (MegaTrain has {', '.join(SCHEDULES)} and the "
                   "torch.optim.lr_scheduler classes)")
    p = dict(_section(sec, "params", "scheduler."))
    sig = _scheduler_signature(kind)
    accepted = [n for n in sig.parameters if n not in ("self", "optimizer")]
    _check_keys(p, accepted, "scheduler.params.")
    if kind in SCHEDULES:
        if p.get("warmup_min_lr") == AUTO:
            p["warmup_min_lr"] = 0
        if p.get("warmup_max_lr") == AUTO:
            if opt is None and getattr(args, "learning_rate", None) is None:
                raise _err("'scheduler.params.warmup_max_lr' is \"auto\" but there is no optimizer section to take "
                           "the learning rate from; write the peak learning rate")
            p["warmup_max_lr"] = opt.lr if opt is not None else args.learning_rate
        if p.get("warmup_num_steps") == AUTO:
            p["warmup_num_steps"] = _from_args(args, "warmup_steps", "scheduler.params.warmup_num_steps",
                                               "write the number of warm-up steps")
        if p.get("total_num_steps") == AUTO:
            p["total_num_steps"] = _from_args(args, "max_steps", "scheduler.params.total_num_steps",
                                              "write the total number of optimizer steps")
        for k in ("warmup_num_steps", "total_num_steps"):
            if k in p:
                _int(p[k], f"scheduler.params.{k}", minimum=1)
        if "last_batch_iteration" in p:
            _int(p["last_batch_iteration"], "scheduler.params.last_batch_iteration", minimum=-1)
        if kind in ("WarmupDecayLR", "WarmupCosineLR") and "total_num_steps" not in p:
            raise _err(f"{kind} needs 'scheduler.params.total_num_steps'")
        for k in ("warmup_min_lr", "warmup_max_lr"):
            if k in p and p[k] is not None:
                vals = p[k] if isinstance(p[k], list) else [p[k]]
                for v in vals:
                    _lr(v, f"scheduler.params.{k}")
        for k in ("warmup_min_ratio", "cos_min_ratio"):
            if k in p:
                _float(p[k], f"scheduler.params.{k}", minimum=0.0)
        if "warmup_type" in p and p["warmup_type"] not in WARMUP_TYPES:
            raise _err(f"'scheduler.params.warmup_type' must be one of {WARMUP_TYPES}, got {p['warmup_type']!r}")
    else:
        missing = [n for n, prm in sig.parameters.items()
                   if n not in ("self", "optimizer") and prm.default is inspect.Parameter.empty
                   and prm.kind not in (prm.VAR_POSITIONAL, prm.VAR_KEYWORD) and n not in p]
        if missing:
            raise _err(f"scheduler {kind} needs 'scheduler.params.{missing[0]}'")
        if any(v == AUTO for v in p.values()):
            raise _err(f"\"auto\" cannot be resolved for the torch scheduler {kind}; write the values")
    return SchedulerSpec(kind, p)


def _precision(d: dict[str, Any], args: Any, ignored: list[str], script: bool) -> bool | None:
    """bf16.enabled (None: the Accelerate face's mixed_precision decides); fp16 and the others refused."""
    bf_key, bf = bf16_section(d, _err)
    _check_keys(bf, _BF16_KEYS, f"{bf_key}.")
    bf_on = bf16_enabled(d, args=args, script=script, err=_err)
    ignored += [f"{bf_key}.{k}" for k in bf if k != "enabled"]

    fp = _section(d, "fp16")
    _check_keys(fp, _FP16_KEYS, "fp16.")
    fp_on = fp.get("enabled", False)
    if fp_on == AUTO:
        fp_on = bool(getattr(args, "fp16", False)) if args is not None else False
    if _bool(fp_on, "fp16.enabled"):
        raise _err("fp16 is not supported by MegaTrain (FP32 masters with bf16 compute need no loss scaling); "
                   "set \"bf16\": {\"enabled\": true} instead and drop \"fp16\"")
    for key in ("amp", "torch_autocast"):
        sec = _section(d, key)
        on = sec.get("enabled", False)
        if on is True:
            raise _err(f"'{key}' mixed precision is not supported; use \"bf16\": {{\"enabled\": true}}")
        if sec:
            ignored.append(key)
    return bf_on


def _zero(d: dict[str, Any], ignored: list[str]) -> ZeroSpec:
    z = _section(d, "zero_optimization")
    _check_keys(z, _ZERO_KEYS, "zero_optimization.")
    stage = z.get("stage", 0)
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise _err(f"'zero_optimization.stage' must be 0, 1, 2 or 3, got {stage!r}")
    pins: list[bool] = []
    devices = {}
    nvme_path = None
    for sec_name, known in _OFFLOAD_KEYS.items():
        sec = _section(z, sec_name, "zero_optimization.")
        _check_keys(sec, known, f"zero_optimization.{sec_name}.")
        dev = sec.get("device", "none")
        if dev not in _OFFLOAD_DEVICES:
            raise _err(f"'zero_optimization.{sec_name}.device' must be one of {_OFFLOAD_DEVICES}, got {dev!r}")
        devices[sec_name] = dev
        if "pin_memory" in sec:
            pins.append(_bool(sec["pin_memory"], f"zero_optimization.{sec_name}.pin_memory"))
        used = ("device", "pin_memory", "nvme_path") if dev == "nvme" else ("device", "pin_memory")
        ignored += [f"zero_optimization.{sec_name}.{k}" for k in sec if k not in used]
        if dev == "nvme" and sec_name == "offload_param":
            # Training on anyway would put the weights in host memory the user sized for NVMe, and say so in one
            # line among hundreds: the NVMe tier holds the update-only state, the weights stream every pass.
            raise _err("'zero_optimization.offload_param.device' is \"nvme\", but MegaTrain's NVMe tier holds the "
                       "optimizer state only: the weights stay in host memory, read by every forward and backward. "
                       "Set \"device\": \"cpu\" here and keep 'offload_optimizer' on \"nvme\"")
        if dev == "nvme":
            nvme_path = sec.get("nvme_path")
            if not isinstance(nvme_path, str) or not nvme_path:
                raise _err("'zero_optimization.offload_optimizer.device' is \"nvme\" but its 'nvme_path' is "
                           f"{nvme_path!r}; give the directory the optimizer state should spill to")
    ignored += [f"zero_optimization.{k}" for k in z if k not in ("stage", "offload_param", "offload_optimizer")]
    # MegaTrain has one host store for weights and optimizer state: pin it if either section asks.
    pin = any(pins) if pins else None
    return ZeroSpec(stage, devices["offload_param"], devices["offload_optimizer"], pin, nvme_path)


def _dotted_paths() -> frozenset[str]:
    """Every nested key this parser knows, spelled as a dotted path ("zero_optimization.reduce_bucket_size")."""
    paths = [f"zero_optimization.{k}" for k in _ZERO_KEYS]
    paths += [f"zero_optimization.{sec}.{k}" for sec, keys in _OFFLOAD_KEYS.items() for k in keys]
    paths += [f"{sec}.{k}" for sec in ("bf16", "bfloat16") for k in _BF16_KEYS]
    paths += [f"fp16.{k}" for k in _FP16_KEYS]
    paths += ["optimizer.type", "scheduler.type", *(f"optimizer.params.{k}" for k in _ADAM_PARAMS)]
    return frozenset(paths)


def _dotted_keys(d: dict[str, Any]) -> list[str]:
    """The top-level keys written as dotted paths, which the parser accepts and ignores.

    TRL's prepare_deepspeed (a DPO reference model under ZeRO-3) adds "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold" and "zero_optimization.stage3_prefetch_bucket_size"
    to the trainer's config as top-level keys; DeepSpeed reads no top-level key of that form, and the sizes
    mean nothing to MegaTrain either. A dotted key naming no known setting is a user's typo and is refused.
    """
    dotted = [k for k in d if isinstance(k, str) and "." in k and k not in _TOP_LEVEL]
    known = _dotted_paths()
    for key in dotted:
        if key not in known:
            raise _unknown("")(key, close_match(key, known))
    return dotted


def _engine(d: dict[str, Any], bf16: bool | None, zero: ZeroSpec, mixed_precision: str | None) -> EngineConfig:
    sec = dict(_section(d, "megatrain"))
    try:
        # The user's own values are checked before they are combined (with bf16.enabled's dtype, which the
        # host-memory modes depend on).
        EngineConfig.from_dict({"compute_dtype": "bfloat16", **sec} if bf16 else sec)
    except (TypeError, ValueError) as e:
        raise _err(f"'megatrain' section: {e}") from e
    said = bf16 if "bf16" in d or "bfloat16" in d else None  # an absent section says nothing
    # DeepSpeed trains in FP32 unless bf16 is enabled.
    sec["compute_dtype"] = EngineConfig.settle_compute_dtype(written=sec.get("compute_dtype"), bf16=said,
                                                             mixed_precision=mixed_precision, unsaid="float32",
                                                             err=_err)
    if "pin_memory" not in sec and zero.pin_memory is not None:
        sec["pin_memory"] = zero.pin_memory
    if zero.nvme_path is not None:
        if sec.get("nvme_path", zero.nvme_path) != zero.nvme_path:
            raise _err(f"'megatrain.nvme_path' is {sec['nvme_path']!r} but "
                       f"'zero_optimization.offload_optimizer.nvme_path' is {zero.nvme_path!r}; drop one of them")
        sec["nvme_path"] = zero.nvme_path
    return EngineConfig.from_dict(sec)


# ---------------------------------------------------------------------------------------------------
# entry points


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # A key given twice would silently keep the last value; DeepSpeed refuses it too.
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _err(f"key {key!r} appears twice in one object; keep one")
        out[key] = value
    return out


def _read_config_text(path: Path) -> Any:
    """A DeepSpeed config file: JSON, or hjson (comments, unquoted keys, trailing commas) as DeepSpeed reads it."""
    text = path.read_text()
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as json_error:
        try:
            import hjson
        except ImportError:
            raise _err(f"{path} is not valid JSON ({json_error}); DeepSpeed also reads hjson (comments, trailing "
                       "commas): pip install hjson to read it the same way") from json_error
        try:
            return hjson.loads(text, object_pairs_hook=_no_duplicates)
        except hjson.HjsonDecodeError as e:
            raise _err(f"{path} is neither valid JSON nor valid hjson: {e}") from e


def load_config_dict(config: dict[str, Any] | str | os.PathLike) -> dict[str, Any]:
    """The config as a dict: a dict is copied, a str/path is read as a JSON (or hjson) file."""
    if isinstance(config, dict):
        return json.loads(json.dumps(config))  # a deep copy that also proves it is plain JSON data
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if not path.is_file():
            raise FileNotFoundError(f"DeepSpeed config file {str(path)!r} does not exist")
        d = _read_config_text(path)
        if not isinstance(d, dict):
            raise _err(f"{path} must hold a JSON object, got {type(d).__name__}")
        return d
    raise TypeError(f"config must be a dict or a path to a .json file, got {type(config).__name__}")


def parse_config(config: dict[str, Any] | str | os.PathLike, args: Any = None, *, warn: bool = True,
                 warn_fn: Callable[[str], None] | None = None, world_size: int = 1,
                 mixed_precision: str | None = None, script: bool = False) -> DeepSpeedConfig:
    """Parse and validate a DeepSpeed config for MegaTrain.

    `args`: an optional TrainingArguments-like object used to resolve "auto" values as Hugging Face does.
    `world_size`: the data-parallel ranks the batch sizes are split over (DeepSpeed's dp world size).
    `script`: the Accelerate face reads the config, whose script fills "auto" clipping (its clip_grad_norm_
    calls) and bf16 (its `mixed_precision`, "no" or "bf16"; None: not given).
    Raises `DeepSpeedConfigError` (a ValueError) naming the offending key. With `warn`, the accepted
    settings that have no effect are named in one warning.
    """
    d = load_config_dict(config)
    ignored: list[str] = _dotted_keys(d)
    _check_keys({k: v for k, v in d.items() if k not in ignored}, _TOP_LEVEL, "")
    ignored += [k for k in d if k in _NO_MEANING and k not in _ADDED_BY_TRAINERS]

    tb, mb, ga = _batch_sizes(d, args, world_size)
    clip = clipping(d, args=args, script=script, err=_err)
    opt = _optimizer(d, args)
    sched = _scheduler(d, opt, args)
    said = _precision(d, args, ignored, script)
    zero = _zero(d, ignored)
    steps_per_print = d.get("steps_per_print")
    if isinstance(steps_per_print, float) and steps_per_print == math.inf:
        steps_per_print = None  # accelerate writes inf to mean "never print", as DeepSpeed reads it
    elif steps_per_print is not None:
        steps_per_print = _int(steps_per_print, "steps_per_print", minimum=1)
    wall = _bool(d.get("wall_clock_breakdown", False), "wall_clock_breakdown")
    drop_last = _bool(d.get("dataloader_drop_last", False), "dataloader_drop_last")
    if not _bool(d.get("managed_gradient_accumulation", True), "managed_gradient_accumulation"):
        raise _err("'managed_gradient_accumulation': false is not supported; MegaTrain counts micro-steps itself")
    engine = _engine(d, said, zero, mixed_precision)
    bf16 = bool(said)
    if engine.optimizer_in_backward and (clip > 0 or ga > 1):
        raise _err(f"'megatrain.optimizer_in_backward' updates each layer during backward, before the global gradient "
                   f"norm or the next micro-batch exists: set 'gradient_clipping': 0 (DeepSpeed's default is 1.0) and "
                   f"'gradient_accumulation_steps': 1, or drop optimizer_in_backward (now gradient_clipping={clip:g}, "
                   f"gradient_accumulation_steps={ga})")
    if engine.host_grad_dtype == "bfloat16" and not engine.optimizer_in_backward and ga > 1:
        raise _err(f"'megatrain.host_grad_dtype': 'bfloat16' cannot sum micro-batches exactly (gradient_accumulation_steps"
                   f"={ga}): set 'gradient_accumulation_steps': 1, or host_grad_dtype 'float32'")

    resolved = dict(d)
    resolved.update(zip(FACE_KEYS[:4], (tb, mb, ga, clip)))  # the batch sizes and the clip, "auto" filled
    if opt is not None and opt.type == "SGD":
        resolved["optimizer"] = {"type": "SGD", "params": {"lr": opt.lr, "momentum": opt.momentum,
                                                           "dampening": opt.dampening, "weight_decay": opt.weight_decay,
                                                           "nesterov": opt.nesterov}}
    elif opt is not None:
        resolved["optimizer"] = {"type": opt.type, "params": {"lr": opt.lr, "betas": list(opt.betas), "eps": opt.eps,
                                                              "weight_decay": opt.weight_decay}}
    if sched is not None:
        resolved["scheduler"] = {"type": sched.type, "params": dict(sched.params)}
    cfg = DeepSpeedConfig(
        train_batch_size=tb, train_micro_batch_size_per_gpu=mb, gradient_accumulation_steps=ga,
        gradient_clipping=clip, optimizer=opt, scheduler=sched, bf16=bf16, zero=zero,
        steps_per_print=steps_per_print, wall_clock_breakdown=wall, dataloader_drop_last=drop_last,
        engine=engine, ignored=tuple(ignored), resolved=resolved,
    )
    if warn and ignored:
        msg = ("MegaTrain accepts but ignores these DeepSpeed settings (they have no meaning when one process "
               f"streams layers from host memory): {', '.join(ignored)}")
        (warn_fn or (lambda m: warnings.warn(m, UserWarning, stacklevel=3)))(msg)
    return cfg
