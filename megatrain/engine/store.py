"""Host store: every layer's FP32 master weights and gradients in one contiguous host buffer each.

The optimizer sees ordinary `nn.Parameter`s that are views into these buffers (their `.grad` views
into the gradient slab), so any torch optimizer runs over the host store unchanged and its state
(Adam m, v) lives in host memory too. A bf16 shadow of each layer is kept only when the device
computes in bf16, so what crosses the link is 2 bytes per parameter, not 4.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from .pinned import Pinner, host_buffer


def host_empty(numel: int, dtype: torch.dtype, pin: bool | Pinner | None, what: str = "host buffers") -> torch.Tensor:
    """A zero-filled, page-aligned host buffer on its own mapping; pinned when `pin` is a Pinner (or True: one
    registering with CUDA). Pinning either succeeds or raises PinnedMemoryError: never a silent fallback."""
    pinner = Pinner() if pin is True else (pin or None)
    return pinner.buffer(numel, dtype, what) if pinner is not None else host_buffer(numel, dtype)


@dataclass
class Slot:
    name: str
    shape: torch.Size
    offset: int
    numel: int


class FlatGroup:
    """One contiguous FP32 master buffer + gradient slab for a set of named tensors (a layer, or the globals)."""

    def __init__(self, named_shapes: Iterable[tuple[str, torch.Size]], shadow_dtype: torch.dtype | None):
        self.slots: list[Slot] = []
        offset = 0
        for name, shape in named_shapes:
            n = int(torch.Size(shape).numel())
            self.slots.append(Slot(name, torch.Size(shape), offset, n))
            offset += n
        self.numel = offset
        # Fresh mappings are zero-filled: the gradient slab needs no zeroing pass (and pages it never touches
        # cost nothing). Which of these are pinned is the store's choice (HostStore).
        self.master = host_buffer(offset, torch.float32)
        self.grad = host_buffer(offset, torch.float32)
        self.shadow = host_buffer(offset, shadow_dtype) if shadow_dtype is not None else None
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
    """All master weights: one FlatGroup per decoder layer, one for the resident (global) parameters.

    With `pin` (True: register with CUDA; or a Pinner) exactly the buffers a DMA copy reads are pinned
    (pin_model.py): each layer's stream source and the resident parameters' masters, which are uploaded
    after every step. Gradient slabs are written by host threads only (on CUDA gradients land in pinned
    staging first), and an FP32 master behind a bf16 shadow never leaves the host.
    """

    def __init__(self, layer_shapes: list[list[tuple[str, torch.Size]]], global_shapes: list[tuple[str, torch.Size]],
                 pin: bool | Pinner | None, shadow_dtype: torch.dtype | None) -> None:
        self.layers = [FlatGroup(shapes, shadow_dtype) for shapes in layer_shapes]
        self.globals = FlatGroup(global_shapes, None)
        self.pinner = Pinner() if pin is True else (pin or None)
        if self.pinner is not None:
            self.pinner.pin([g.stream_source for g in self.layers] + [self.globals.master],
                            "streamed layer weights and resident masters")

    @property
    def pinned_bytes(self) -> int:
        """Bytes this store (and the buffers made through `buffer`) locked, page-exact."""
        return self.pinner.pinned_bytes if self.pinner is not None else 0

    def buffer(self, numel: int, dtype: torch.dtype, what: str) -> torch.Tensor:
        """A host buffer that a DMA copy will use: pinned exactly when the store is."""
        return host_empty(numel, dtype, self.pinner, what)

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
