"""`deepspeed.initialize` on MegaTrain: the same arguments, the same four results.

The config is parsed and validated completely before the model is touched; the model then goes to the
MegaTrain backend (`megatrain.backend`), which the returned `MegaTrainEngine` holds.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from ..backend import MegatrainBackend
from ..config.resolve import resolve
from ..run import start_line
from .data import make_dataloader
from .deepspeed_engine import MegaTrainEngine
from .zero3_gather import gather_partitioned

__all__ = ["initialize", "add_config_arguments"]


def _param_groups(model: nn.Module, model_parameters: Any) -> list[dict[str, Any]] | None:
    """`model_parameters` (tensors or param-group dicts over `model`'s parameters) as groups of names."""
    if model_parameters is None:
        return None
    names = {id(p): n for n, p in model.named_parameters()}

    def to_names(params: Any) -> list[str]:
        params = [params] if torch.is_tensor(params) else list(params)
        out = []
        for p in params:
            if id(p) not in names:
                raise ValueError("model_parameters holds a tensor that is not a parameter of `model`")
            if p.requires_grad:
                out.append(names[id(p)])
        return out

    items = list(model_parameters)
    if items and all(isinstance(g, dict) for g in items):
        return [{**{k: v for k, v in g.items() if k != "params"}, "params": to_names(g["params"])} for g in items]
    return [{"params": to_names(items)}]


def _on_engine(groups: list[dict[str, Any]] | None, named: list[tuple[str, nn.Parameter]]) -> list[Any]:
    if groups is None:
        return [p for _, p in named]
    by_name = dict(named)
    out = []
    for g in groups:
        missing = [n for n in g["params"] if n not in by_name]
        if missing:
            raise ValueError(f"model_parameters names {missing[0]!r}, which the engine does not hold")
        out.append({**g, "params": [by_name[n] for n in g["params"]]})
    return out


def _resolve_config(args: Any, config: Any, config_params: Any) -> Any:
    if config is not None and config_params is not None:
        raise ValueError("give the DeepSpeed config as `config` or `config_params`, not both")
    config = config if config is not None else config_params
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if from_args is not None:
        if config is not None:
            raise ValueError("a DeepSpeed config was given both in args.deepspeed_config and to initialize(); "
                             "keep one")
        config = from_args
    if config is None:
        raise ValueError("initialize() needs a DeepSpeed config: pass config=<dict or path to .json> "
                         "(or args.deepspeed_config)")
    return config


def initialize(args: Any = None, model: nn.Module | None = None, optimizer: Any = None, model_parameters: Any = None,
               training_data: Any = None, lr_scheduler: Any = None, distributed_port: int | None = None,
               mpu: Any = None, dist_init_required: bool | None = None, collate_fn: Callable | None = None,
               config: dict[str, Any] | str | os.PathLike | None = None, mesh_param: Any = None,
               config_params: dict[str, Any] | str | os.PathLike | None = None
               ) -> tuple[MegaTrainEngine, torch.optim.Optimizer | None, DataLoader | None, Any]:
    """`deepspeed.initialize`, on MegaTrain: returns (engine, optimizer, training dataloader, lr scheduler).

    The config is parsed and validated completely before the model is touched. `optimizer` may be a
    torch optimizer over `model.parameters()` (taken over by the engine; DeepSpeed's `DeepSpeedCPUAdam` is
    replaced by torch's AdamW over the same groups, `exact_adam.py`) or a callable taking the
    parameters; otherwise the config's optimizer section is used (over `model_parameters` when
    given, which may be param groups). `lr_scheduler` may be a scheduler or a callable taking the
    optimizer; otherwise the config's scheduler section is used.
    """
    from ..engine import launch_env

    world = launch_env().world_size  # a malformed launch environment is refused here, before the config
    cfg = resolve(_resolve_config(args, config, config_params), face="deepspeed", args=args, world_size=world).deepspeed
    if model is None:
        raise ValueError("initialize() needs a model (a Hugging Face causal LM)")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a Hugging Face causal LM), got {type(model).__name__}")
    if mpu is not None or mesh_param is not None:
        raise ValueError("mpu / mesh_param (model or pipeline parallel groups) are not supported: MegaTrain's only "
                         "parallelism is data parallel over all ranks of the launch")
    if isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler) and not isinstance(optimizer,
                                                                                          torch.optim.Optimizer):
        raise ValueError("an instantiated lr_scheduler needs the optimizer it was built on passed as `optimizer`")
    if optimizer is not None and cfg.optimizer is not None:
        warnings.warn("both an optimizer and a config 'optimizer' section were given; using the optimizer passed in "
                      "(as DeepSpeed does)", stacklevel=2)
    has_optimizer = optimizer is not None or cfg.optimizer is not None
    if cfg.scheduler is not None and lr_scheduler is None and not has_optimizer:
        raise ValueError("the config's 'scheduler' section needs an optimizer (an 'optimizer' section or one passed in)")

    # A model DeepSpeed's ZeRO-3 partitioner built (HfDeepSpeedConfig at from_pretrained) is made whole once.
    gathered, model_parameters = gather_partitioned(model, optimizer, model_parameters)
    groups = _param_groups(model, model_parameters)
    if isinstance(optimizer, torch.optim.Optimizer):
        # Checked here because the engine finds out only after it has packed the model into its store.
        own = {id(p) for p in model.parameters()}
        if any(id(p) not in own for g in optimizer.param_groups for p in g["params"]):
            raise ValueError("the optimizer holds a tensor that is not a parameter of `model`; build it over "
                             "model.parameters()")
        engine_opt: Any = optimizer
    elif optimizer is not None:
        if not callable(optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer or a callable, got {type(optimizer).__name__}")
        client = optimizer

        def engine_opt(named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
            # Called while the backend below builds the engine; a DeepSpeedCPUAdam it returns is replaced too.
            return backend.exact_optimizer(client(_on_engine(groups, named)))
    elif cfg.optimizer is not None:
        spec = cfg.optimizer

        def engine_opt(named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
            return spec.build(_on_engine(groups, named))
    else:
        engine_opt = None

    # The backend `megatrain.Accelerator(backend="megatrain")` holds, clipping by the config at every boundary;
    # it prepares the model as for that face (pinning, HF's checkpointing, TRL's fused head: prepare_model).
    backend = MegatrainBackend(config=cfg.engine, mixed_precision=None, gradient_clipping=cfg.gradient_clipping)
    backend.prepare(model, engine_opt)
    eng = backend.engine
    opt = eng.optimizer if has_optimizer else None
    turned_off = list(backend.turned_off)  # for the run's start line
    if gathered:
        turned_off.append(f"DeepSpeed's ZeRO-3 partitioning ({gathered} parameters gathered whole once)")

    if lr_scheduler is not None:
        is_sched = hasattr(lr_scheduler, "step") and hasattr(lr_scheduler, "state_dict")
        sched = lr_scheduler if is_sched or not callable(lr_scheduler) else lr_scheduler(opt)
    elif cfg.scheduler is not None:
        sched = cfg.scheduler.build(opt)
    else:
        sched = None

    loader = None
    if training_data is not None:
        loader = make_dataloader(training_data, cfg.train_micro_batch_size_per_gpu, collate_fn,
                                 cfg.dataloader_drop_last, world_size=eng.world_size, rank=eng.rank)
    engine = MegaTrainEngine(backend, cfg, opt, sched, model, loader, collate_fn)
    if cfg.ignored:
        shown = ", ".join(cfg.ignored[:4]) + (f" and {len(cfg.ignored) - 4} more" if len(cfg.ignored) > 4 else "")
        turned_off.append(f"DeepSpeed settings without meaning here: {shown}")
    start_line.announce(start_line.describe("DeepSpeed (megatrain.initialize)", eng, opt, turned_off,
                                            backend.replaced_optimizer), eng)
    return engine, opt, loader, sched


def add_config_arguments(parser: Any) -> Any:
    """DeepSpeed's command-line flags (--deepspeed, --deepspeed_config), so `args.deepspeed_config` works."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true", help="enable the DeepSpeed(-style) engine")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file")
    return parser
