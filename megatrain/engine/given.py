"""What a caller hands an engine after it is built, resolved against the engine's masters: another optimizer
(`Engine.replace_optimizer`) and a list of parameters to clip (`Engine.clip_grad_norm_of`).

Both take tensors the user holds (the model's parameters as they were before the engine took the model, each
emptied when it was copied into the store; the host masters; the resident parameters' device copies; hilo's
per-call copies) and find the master each stands for; both keep DeepSpeed's rule on what trains (model/trainable.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..costs.modes import GradSlab
from .update.clipping import checked_max_norm
from .update.optim import move_onto_masters


def replace_optimizer(engine: Any, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Step `optimizer` (the same object, its hyper-parameters and param groups) instead of the one the engine
    was built with, before the first step: a face's prepare(model) followed by prepare(optimizer).

    It may hold the model's parameters as they were before the engine took the model (each emptied when it
    was copied into the store), the host masters, or the resident parameters' device copies; its state is
    dropped. Refused once the current optimizer has stepped, and where the update path was built over
    it a layer at a time (give the optimizer with the model then)."""
    if any(engine.optimizer.state.values()):
        raise RuntimeError("the model has trained with its current optimizer already; replace the optimizer "
                           "before the first step")
    if engine.update.layered is not None:
        raise RuntimeError("this engine updates a layer at a time (optimizer_overlap or a host mode) with views "
                           "of the optimizer it was built with; pass the model and its optimizer together")
    masters = dict(engine.named_parameters())
    name_of = {id(p): n for n, p in masters.items()}
    by_master = {id(d): name_of[id(m)] for d, m in zip(engine.placement.device_globals, engine.store.globals.params)
                 if id(m) in name_of}

    def name(p: torch.Tensor) -> str | None:
        # An id alone could belong to a new tensor that reused a dead original's address, so only an emptied
        # tensor is taken for an original (the engine emptied each when it copied it into the store). The model
        # object serves a copy of a master where the compute copy is bf16 (model_object.py): named by what it copies.
        p = getattr(p, "megatrain_copy_of", p)
        known = name_of.get(id(p)) or by_master.get(id(p))
        return known if known is not None or p.numel() != 0 else engine._name_of.get(id(p))

    move_onto_masters(optimizer, name, masters)
    hold_trainable(engine, optimizer)
    engine.optimizer = optimizer
    return optimizer


def hold_trainable(engine: Any, optimizer: torch.optim.Optimizer) -> None:
    """DeepSpeed's rule on `optimizer` (trainable.py): the frozen masters out of its groups, and a trainable one
    it does not hold (left out of model_parameters) frozen from now on."""
    engine.trainable.strip(optimizer)
    left_out = engine.trainable.not_held(optimizer, engine.store.named_parameters(engine.parts.layers_prefix))
    if left_out:
        engine.trainable.freeze(left_out)
        engine.trainable.apply(engine.placement.device_globals)


def clip_grad_norm_of(engine: Any, parameters: list[torch.Tensor], max_norm: float) -> float:
    """torch's clip_grad_norm_(parameters, max_norm): the norm over the gradients of `parameters` (the model's
    own tensors: its parameters, the masters, the resident ones' device copies) and only theirs scaled. Those
    that include every trainable parameter take the engine's clip (a frozen one has no gradient, so the norm is
    the same); a part of them needs FP32 slabs with no clip pending on them, and is refused otherwise."""
    max_norm = checked_max_norm(max_norm)
    master_of = {id(p): p for _, p in engine.store.named_parameters(engine.parts.layers_prefix)}
    master_of.update({id(d): m for d, m in zip(engine.placement.device_globals, engine.store.globals.params)})
    by_name = dict(engine.store.named_parameters(engine.parts.layers_prefix))
    by_name.update({a: by_name[n] for a, n in engine._aliases.items() if n in by_name})
    given: dict[int, nn.Parameter] = {}
    for t in parameters:
        m = master_of.get(id(t), master_of.get(id(getattr(t, "megatrain_copy_of", None))))  # hilo: a copy's
        if m is None and t.numel() == 0:  # one of the model's own, emptied when the engine took it (listed before)
            m = by_name.get(engine._name_of.get(id(t), ""))
        if m is None:
            raise ValueError("clip_grad_norm_ was given a tensor that is not a parameter of the engine's model; "
                             "pass model.parameters() (or a part of them)")
        given[id(m)] = m
    trainable = [p for p in master_of.values() if engine.trainable.trains(p)]
    if all(id(p) in given for p in trainable):
        return engine.clip_grad_norm_(max_norm)
    if engine.store.grad_mode is not GradSlab.FLOAT32 or engine.clipping.pending:
        raise ValueError(f"clip_grad_norm_ over a part of the trainable parameters needs FP32 gradient slabs with "
                         f"no clip pending on them (host_grad_dtype={engine.config.host_grad_dtype!r}); clip over "
                         "all trainable parameters (model.parameters()), or use host_grad_dtype='float32'")
    engine._all_grads()  # landed, no update queued
    for i, g in enumerate(engine.store.layers):
        if g.grad is not None:
            engine.events.slabs.zero_if_fresh(i, g.grad)  # no backward since zero_grad(): its zeros
        g.link_grads()
    engine.store.globals.link_grads()
    part = [p for p in given.values() if engine.trainable.trains(p)]
    total = float(torch.nn.utils.clip_grad_norm_(part, max_norm)) if part else 0.0
    engine.grads_written()  # the slabs were scaled in place: no cached norm holds
    engine.clipping.clipped_by_caller(total)
    return total
