"""One MegaTrain engine per model, even when a trainer initializes DeepSpeed twice on it.

TRL's DPOTrainer with `precompute_ref_log_probs=True` scores the reference log-probabilities with the policy
itself before training: it wraps the policy in a forward-only DeepSpeed engine (`trl.models.prepare_deepspeed`:
`deepspeed.initialize(model=policy, config=...)`, no optimizer), and later Trainer initializes the same model again
to train it. On MegaTrain the first call already moved the model into an engine's host store; building a second
engine over it would pack a store of a store. So a forward-only engine is remembered per model, and the training
initialize of that model adopts the trainer's optimizer into it (`MegatrainBackend.prepare(None, optimizer)`)
instead: the reference pass costs no second copy of the model, and it ran through the same engine.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

from ..run import start_line

# model -> the forward-only MegaTrainEngine built over it (weak: a model dropped by the user frees its engine)
_forward_only: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def _config_dict(config: Any) -> dict[str, Any]:
    from ..config.deepspeed import load_config_dict

    if isinstance(config, dict):
        return config
    if hasattr(config, "config") and isinstance(config.config, dict):
        return config.config
    return load_config_dict(config)


def initialize_once(mt_initialize: Callable[..., Any], args: Any, rest: tuple, kwargs: dict[str, Any]) -> Any:
    """`mt_initialize(args, *rest, **kwargs)`, except for a model a forward-only call already put on an engine:
    that engine is returned (forward-only again) or takes over the optimizer and scheduler (to train)."""
    bound = inspect.signature(mt_initialize).bind(args, *rest, **kwargs)
    a = bound.arguments
    model = a.get("model")
    earlier = _forward_only.get(model) if isinstance(model, nn.Module) else None
    config = next((a[k] for k in ("config", "config_params") if a.get(k) is not None), None)
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None)
    wants_optimizer = a.get("optimizer") is not None or (config is not None and "optimizer" in _config_dict(config))
    if earlier is None:
        result = mt_initialize(*bound.args, **bound.kwargs)
        if not wants_optimizer and a.get("lr_scheduler") is None and isinstance(model, nn.Module):
            _forward_only[model] = result[0]
        return result
    if not wants_optimizer:
        return earlier, None, None, None
    return _train_on(earlier, model, a, config)


def _train_on(earlier: Any, model: nn.Module, a: dict[str, Any], config: Any) -> Any:
    """The training initialize of a model whose forward-only engine exists: same store, the trainer's optimizer."""
    import torch

    from ..config.deepspeed import parse_config
    from ..deepspeed.deepspeed_engine import MegaTrainEngine
    from ..engine import launch_env

    optimizer, lr_scheduler = a.get("optimizer"), a.get("lr_scheduler")
    if not isinstance(optimizer, torch.optim.Optimizer) or a.get("training_data") is not None \
            or a.get("model_parameters") is not None:
        raise NotImplementedError(
            "this model is on a forward-only MegaTrain engine already (TRL's reference pass); training it through "
            "a second deepspeed.initialize takes only a torch optimizer (and an lr_scheduler): what Trainer passes")
    cfg = parse_config(config, args=a.get("args"), world_size=launch_env().world_size)
    backend = earlier.backend
    eng = backend.engine
    # Trainer built the optimizer over model.parameters() after the engine bound the model (the resident
    # parameters are then the engine's device copies: Engine.replace_optimizer knows them by their masters).
    # The optimizer that steps: the one given, or torch's AdamW for DeepSpeed's CPU Adam (backend/exact_adam.py).
    _, optimizer = backend.prepare(None, optimizer)
    backend.set_clipping(cfg.gradient_clipping)  # the training config's clipping, not the reference pass's
    if lr_scheduler is not None and not (hasattr(lr_scheduler, "step") and hasattr(lr_scheduler, "state_dict")):
        lr_scheduler = lr_scheduler(optimizer) if callable(lr_scheduler) else lr_scheduler
    _forward_only.pop(model, None)
    engine = MegaTrainEngine(backend, cfg, optimizer, lr_scheduler, model, None, a.get("collate_fn"))
    start_line.announce(start_line.describe("DeepSpeed (megatrain.initialize, the forward-only engine now training)",
                                            eng, optimizer, None, backend.replaced_optimizer), eng)
    return engine, optimizer, None, lr_scheduler
