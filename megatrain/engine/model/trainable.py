"""Which of the model's parameters train: the user's `requires_grad` flags, and DeepSpeed's rule that a parameter
left out of the optimizer's groups (or of `model_parameters`) does not train either.

A frozen parameter keeps `requires_grad=False` on the model object (the store's master carries the user's flag),
gets no gradient computed (its leaf in each layer's backward does not require one), no slab where its whole layer
is frozen (a frozen resident parameter: none either, the resident slab ends before it), is held by no optimizer group (so no Adam state, no update), and adds nothing to the
clip norm or the non-finite check. Backward stops below the lowest layer that trains when nothing before the
layers trains (`backward_floor`); a layer trains there when a resident parameter it reads does (PEFT's adapters,
layer_adapters.py), though its own buffer, frozen, has no slab and sends nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ...models.adapter import DecoderParts
from ..host.pinned import host_buffer
from ..host.store import HostStore


def user_flags(model: nn.Module) -> dict[str, bool]:
    """Each parameter's requires_grad as the user set it, by its first name."""
    return {n: p.requires_grad for n, p in model.named_parameters()}


def frozen_names(model: nn.Module, optimizer: object = None) -> set[str]:
    """The parameters (each by its first name) that do not train: requires_grad False, or, with an optimizer
    object given, not in any of its groups."""
    first: dict[int, str] = {}
    for name, p in model.named_parameters():
        first.setdefault(id(p), name)
    params = {id(p): p for p in model.parameters()}
    frozen = {n for i, n in first.items() if not params[i].requires_grad}
    if isinstance(optimizer, torch.optim.Optimizer):
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        frozen |= {n for i, n in first.items() if i not in held}
    return frozen


class Trainable:
    """What trains, per layer slot and per resident (global) slot of the host store."""

    def __init__(self, store: HostStore, parts: DecoderParts, frozen: Iterable[str],
                 flags: dict[str, bool] | None = None) -> None:
        """`frozen`: what does not train; `flags`: the user's requires_grad by name (None: not frozen = True), what
        the masters show: a parameter left out of the optimizer keeps its True and trains no more for it."""
        self.store, self.parts = store, parts
        self.frozen: set[str] = set(frozen)
        self.flags = flags
        self._refresh()

    def _refresh(self) -> None:
        prefix = self.parts.layers_prefix
        self.layers = [[f"{prefix}.{i}.{s.name}" not in self.frozen for s in g.slots]
                       for i, g in enumerate(self.store.layers)]
        self.globals = [s.name not in self.frozen for s in self.store.globals.slots]
        # A resident parameter that a layer reads (PEFT's adapters, placement.py): that layer's index, else None.
        self.in_layer = [int(s.name[len(prefix) + 1:].split(".", 1)[0]) if s.name.startswith(prefix + ".") else None
                         for s in self.store.globals.slots]
        self._trains = {id(p): t for g, flags in zip(self.store.groups(), [*self.layers, self.globals])
                        for p, t in zip(g.params, flags)}

    def trains(self, master: nn.Parameter) -> bool:
        """Whether the master `master` (one of the store's) trains."""
        return self._trains.get(id(master), False)

    def freeze(self, names: Iterable[str]) -> None:
        """`names` train no more (left out of the optimizer): a layer none of whose parameters trains now gives up
        its slab, and the resident slab its frozen tail (release)."""
        self.frozen |= set(names)
        self._refresh()
        for g, trains in zip(self.store.groups(), [*self.layers, self.globals]):
            g.trains = trains  # what the slabs' .grad links read (apply() sets the flags)
        self.release()

    def release(self) -> None:
        """No gradient slab for a layer none of whose parameters trains, and the resident slab ends after the last
        resident parameter that trains (trim_resident_slab)."""
        for i, group in enumerate(self.store.layers):
            if not self.layer_trains(i) and group.grad is not None:
                group.drop_grads()
        self.trim_resident_slab()

    @property
    def everything(self) -> bool:
        return not self.frozen

    def layer_trains(self, i: int) -> bool:
        """Whether a parameter of layer i's own buffer trains (it then has a gradient slab)."""
        return any(self.layers[i])

    def layer_backward(self, i: int) -> bool:
        """Whether layer i's backward computes a weight gradient: one of its buffer's, or one of a resident
        parameter it reads (an adapter of its)."""
        return self.layer_trains(i) or any(t and j == i for j, t in zip(self.in_layer, self.globals))

    def layer_weights(self, i: int) -> dict[str, bool]:
        """Layer i's parameters by their name within the layer: whether each trains."""
        return {s.name: t for s, t in zip(self.store.layers[i].slots, self.layers[i])}

    def embed_trains(self, embed_slot: int) -> bool:
        return self.globals[embed_slot]

    def backward_floor(self, device_globals: list[nn.Parameter]) -> int:
        """The lowest layer whose backward must run: the lowest with a trainable parameter, or 0 when a resident
        parameter read before the layers (the embedding, a position table) trains. len(layers): none."""
        after = {id(p) for m in (self.parts.norm, self.parts.lm_head) for p in m.parameters()}
        if any(t and id(d) not in after and j is None for d, t, j in zip(device_globals, self.globals, self.in_layer)):
            return 0
        return next((i for i in range(len(self.layers)) if self.layer_backward(i)), len(self.layers))

    def trim_resident_slab(self) -> None:
        """The resident parameters' gradient slab ends after the last one that trains: the frozen ones were placed
        after the trainable (placement.py), so no slab is held for them. (A parameter frozen later, left out of the
        optimizer, keeps its part where one that trains follows it: it is never written.)"""
        group = self.store.globals
        ends = [s.offset + s.numel for s, t in zip(group.slots, self.globals) if t]
        n = max(ends, default=0)
        if group.grad is None or n == group.grad.numel() or group.grad_work is not group.grad:
            return
        on_host = group.grad.device.type == "cpu"  # else the resident optimizer's (update/resident.py): there
        group.grad = group.grad_work = (host_buffer(n, torch.float32) if on_host else
                                        torch.zeros(n, dtype=torch.float32, device=group.grad.device))
        group.link_grads()

    def apply(self, device_globals: list[nn.Parameter]) -> None:
        """The user's flags onto the masters (what the model object holds) and the resident device copies, what
        trains onto the groups (a master that does not train has no .grad); then no slab for what does not train
        (release)."""
        prefix = self.parts.layers_prefix

        def flag(name: str, t: bool) -> bool:  # the user's, where known; else whether it trains
            return t if self.flags is None else self.flags.get(name, t)

        for i, (g, trains) in enumerate(zip(self.store.layers, self.layers)):
            g.trains = trains
            for s, p, t in zip(g.slots, g.params, trains):
                p.requires_grad_(flag(f"{prefix}.{i}.{s.name}", t))
        self.store.globals.trains = self.globals
        for s, p, d, t in zip(self.store.globals.slots, self.store.globals.params, device_globals, self.globals):
            p.requires_grad_(flag(s.name, t))
            d.requires_grad_(flag(s.name, t))
        for g in self.store.groups():
            g.link_grads()
        self.release()  # a frozen embedding (head, norm, a wholly frozen layer) has no slab either

    @contextmanager
    def idle_unflagged(self, device_globals: list[nn.Parameter]) -> Iterator[None]:
        """Within it, the resident parameters that keep the user's requires_grad=True but do not train (left out of
        the optimizer) show requires_grad=False, so the loss tile, which computes a gradient for every head/norm
        tensor that requires one as it goes (layer/loss.py), computes none for them; the flags are the user's again
        after."""
        idle = [d for d, t in zip(device_globals, self.globals) if d.requires_grad and not t]
        for d in idle:
            d.requires_grad_(False)
        try:
            yield
        finally:
            for d in idle:
                d.requires_grad_(True)

    def strip(self, optimizer: torch.optim.Optimizer) -> None:
        """Take the frozen masters out of `optimizer`'s groups (DeepSpeed's rule: an optimizer over
        model.parameters() steps the trainable ones); the groups themselves stay, for LR schedules."""
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if self.trains(p)]

    def not_held(self, optimizer: torch.optim.Optimizer, named: list[tuple[str, nn.Parameter]]) -> set[str]:
        """The trainable masters `optimizer` does not hold (left out of model_parameters): frozen too."""
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        return {n for n, p in named if self.trains(p) and id(p) not in held}
