"""Host store: every layer's FP32 master weights and gradients in one contiguous host buffer each.

The optimizer sees ordinary `nn.Parameter`s that are views into these buffers (their `.grad` views
into the gradient slab), so any torch optimizer runs over the host store unchanged and its state
(Adam m, v) lives in host memory too. A bf16 shadow of each layer is kept only when the device
computes in bf16, so what crosses the link is 2 bytes per parameter, not 4.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

_PAGE = 4096
_pin_failed = False


def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A page-aligned host buffer; pinned when asked, pageable (one warning) when pinning fails."""
    global _pin_failed
    if pin and not _pin_failed:
        try:
            return torch.empty(numel, dtype=dtype, pin_memory=True)  # cudaHostAlloc is page-aligned
        except RuntimeError as exc:
            _pin_failed = True
            warnings.warn(f"pinned host memory unavailable ({exc}); falling back to pageable memory, "
                          "host<->device copies will be slower (check `ulimit -l` in containers)", stacklevel=2)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(numel + _PAGE // itemsize, dtype=dtype)
    skip = (-raw.data_ptr() % _PAGE) // itemsize
    return raw[skip: skip + numel]


@dataclass
class Slot:
    name: str
    shape: torch.Size
    offset: int
    numel: int


class FlatGroup:
    """One contiguous FP32 master buffer + gradient slab for a set of named tensors (a layer, or the globals)."""

    def __init__(self, named_shapes: Iterable[tuple[str, torch.Size]], pin: bool, shadow_dtype: torch.dtype | None):
        self.slots: list[Slot] = []
        offset = 0
        for name, shape in named_shapes:
            n = int(torch.Size(shape).numel())
            self.slots.append(Slot(name, torch.Size(shape), offset, n))
            offset += n
        self.numel = offset
        self.master = host_empty(offset, torch.float32, pin)
        self.grad = host_empty(offset, torch.float32, pin)
        self.grad.zero_()
        self.shadow = host_empty(offset, shadow_dtype, pin) if shadow_dtype is not None else None
        self.params: list[nn.Parameter] = []
        for s in self.slots:
            p = nn.Parameter(self.view(self.master, s), requires_grad=True)
            self.params.append(p)
        self.link_grads()

    @staticmethod
    def view(flat: torch.Tensor, slot: Slot) -> torch.Tensor:
        return flat[slot.offset: slot.offset + slot.numel].view(slot.shape)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {s.name: self.view(flat, s) for s in self.slots}

    def link_grads(self) -> None:
        # An optimizer's zero_grad(set_to_none=True) drops these links; restore them before each step.
        for p, s in zip(self.params, self.slots):
            p.grad = self.view(self.grad, s)

    def refresh_shadow(self) -> None:
        if self.shadow is not None:
            self.shadow.copy_(self.master)

    @property
    def stream_source(self) -> torch.Tensor:
        """What is copied to the device: the bf16 shadow in bf16 mode, else the FP32 master."""
        return self.shadow if self.shadow is not None else self.master


class HostStore:
    """All master weights: one FlatGroup per decoder layer, one for the resident (global) parameters."""

    def __init__(self, layer_shapes: list[list[tuple[str, torch.Size]]], global_shapes: list[tuple[str, torch.Size]],
                 pin: bool, shadow_dtype: torch.dtype | None) -> None:
        self.layers = [FlatGroup(shapes, pin, shadow_dtype) for shapes in layer_shapes]
        self.globals = FlatGroup(global_shapes, pin, None)

    def groups(self) -> list[FlatGroup]:
        return [*self.layers, self.globals]

    def named_parameters(self, layers_prefix: str) -> list[tuple[str, nn.Parameter]]:
        out = []
        for i, g in enumerate(self.layers):
            out += [(f"{layers_prefix}.{i}.{s.name}", p) for s, p in zip(g.slots, g.params)]
        out += [(s.name, p) for s, p in zip(self.globals.slots, self.globals.params)]
        return out

    def host_bytes(self) -> int:
        total = 0
        for g in self.groups():
            total += g.master.numel() * 4 + g.grad.numel() * 4
            if g.shadow is not None:
                total += g.shadow.numel() * g.shadow.element_size()
        return total

    def zero_grad(self) -> None:
        for g in self.groups():
            g.grad.zero_()
