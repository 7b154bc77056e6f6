"""Host store: every layer's FP32 master weights and gradients in one contiguous host buffer each.

The optimizer sees ordinary `nn.Parameter`s that are views into these buffers (their `.grad` views
into the gradient slab), so any torch optimizer runs over the host store unchanged and its state
(Adam m, v) lives in host memory too. A bf16 shadow of each layer is kept only when the device
computes in bf16, so what crosses the link is 2 bytes per parameter, not 4.

The decoder layers' masters can also be kept as an exact hi/lo split or as bf16 only, and their gradient
slabs as bf16 or not at all (optimizer in backward): see megatrain/modes.py. Then the layer Parameters
are views of one shared FP32 scratch that holds a layer's values only while the optimizer updates it
(`unpack()` ... `pack()`); read and write values through `read_slot` / `write_slot`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from ..modes import GradSlab, HostMaster
from . import hilo
from .rounding import round_stochastic

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


class Scratch:
    """FP32 working space of one layer (master values and gradients) for the non-FP32 modes."""

    def __init__(self, numel: int, pin: bool, master: bool, grad: bool) -> None:
        self.master = host_empty(numel, torch.float32, pin) if master else None
        self.grad = host_empty(numel, torch.float32, pin) if grad else None


class FlatGroup:
    """One contiguous FP32 master buffer + gradient slab for a set of named tensors (a layer, or the globals)."""

    def __init__(self, named_shapes: Iterable[tuple[str, torch.Size]], pin: bool, shadow_dtype: torch.dtype | None,
                 master: HostMaster = HostMaster.FP32, grad: GradSlab | None = GradSlab.FLOAT32,
                 scratch: Scratch | None = None):
        self.slots: list[Slot] = []
        offset = 0
        for name, shape in named_shapes:
            n = int(torch.Size(shape).numel())
            self.slots.append(Slot(name, torch.Size(shape), offset, n))
            offset += n
        self.numel = offset
        self.master_mode, self.grad_mode = master, grad
        self.rounding: torch.Generator | None = None  # bf16 master: stochastic rounding's random bits
        self.lo: torch.Tensor | None = None
        self.ties = torch.empty(0, dtype=torch.int64)  # hilo: positions whose hi rounded up at a tie
        if master is HostMaster.FP32:
            self.master = host_empty(offset, torch.float32, pin)
            self.work = self.master
            self.shadow = host_empty(offset, shadow_dtype, pin) if shadow_dtype is not None else None
        else:
            # The bf16 half is the master's own storage and what streams: no shadow, no per-step cast.
            self.master = None
            self.shadow = host_empty(offset, torch.bfloat16, pin)
            if master is HostMaster.HILO:
                self.lo = host_empty(offset, torch.int16, pin)
            self.work = scratch.master[:offset]
        if grad is GradSlab.FLOAT32:
            self.grad = host_empty(offset, torch.float32, pin)
            self.grad_work = self.grad
        else:
            self.grad = host_empty(offset, torch.bfloat16, pin) if grad is GradSlab.BFLOAT16 else None
            self.grad_work = scratch.grad[:offset]
        if self.grad is not None:
            self.grad.zero_()
        self.params: list[nn.Parameter] = []
        for s in self.slots:
            p = nn.Parameter(self.view(self.work, s), requires_grad=True)
            self.params.append(p)
        self.link_grads()

    @property
    def per_layer_update(self) -> bool:
        """Whether the optimizer must update this group on its own, between unpack() and pack()."""
        return self.master_mode is not HostMaster.FP32 or self.grad_mode is not GradSlab.FLOAT32

    @staticmethod
    def view(flat: torch.Tensor, slot: Slot) -> torch.Tensor:
        return flat[slot.offset: slot.offset + slot.numel].view(slot.shape)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {s.name: self.view(flat, s) for s in self.slots}

    def link_grads(self) -> None:
        # An optimizer's zero_grad(set_to_none=True) drops these links; restore them before each step.
        if self.grad_mode is not GradSlab.FLOAT32:
            return  # only the per-layer update reads gradients, from grad_work (load_grads)
        for p, s in zip(self.params, self.slots):
            p.grad = self.view(self.grad, s)

    def refresh_shadow(self) -> None:
        if self.shadow is not None and self.master is not None:
            self.shadow.copy_(self.master)

    # -- the per-layer update of the non-FP32 modes -----------------------------------------------------
    def unpack(self) -> None:
        """Make `work` (what the Parameters view) hold this group's FP32 master values."""
        if self.master_mode is HostMaster.HILO:
            hilo.join(self.shadow, self.lo, self.ties, self.work)
        elif self.master_mode is HostMaster.BF16:
            self.work.copy_(self.shadow)

    def pack(self) -> None:
        """Store `work` back as the master (the exact split, or bf16 RNE); FP32: refresh the shadow."""
        if self.master_mode is HostMaster.FP32:
            self.refresh_shadow()
            return
        if self.master_mode is HostMaster.HILO:
            self.ties = hilo.split(self.work, self.shadow, self.lo)
        elif self.rounding is not None:
            round_stochastic(self.work, self.shadow, self.rounding)
        else:
            self.shadow.copy_(self.work)
        # The scratch is shared by every layer: whoever reads a layer's Parameters outside its update (instead
        # of read_slot / the engine's state_dict) gets NaN, never another layer's plausible-looking weights.
        self.work.fill_(float("nan"))

    def load_grads(self, coefs: list[float]) -> None:
        """Make `grad_work` hold the FP32 gradients, times the clipping coefficients still pending on them (a
        bf16 slab is widened first: the same products as scaling an FP32 slab holding the same values)."""
        if self.grad_mode is GradSlab.BFLOAT16:
            self.grad_work.copy_(self.grad)
            for c in coefs:
                self.grad_work.mul_(c)

    def read_slot(self, slot: Slot) -> torch.Tensor:
        """A new FP32 tensor with one parameter's master values."""
        if self.master_mode is HostMaster.FP32:
            return self.view(self.master, slot).clone()
        a, b = slot.offset, slot.offset + slot.numel
        if self.master_mode is HostMaster.BF16:
            return self.shadow[a:b].float().view(slot.shape)
        ties = self.ties[(self.ties >= a) & (self.ties < b)] - a
        return hilo.join(self.shadow[a:b], self.lo[a:b], ties, torch.empty(slot.numel)).view(slot.shape)

    def write_slot(self, slot: Slot, value: torch.Tensor) -> None:
        """Set one parameter's master values (an FP32 master's shadow: refresh_shadow() after)."""
        if self.master_mode is HostMaster.FP32:
            self.view(self.master, slot).copy_(value)
            return
        a, b = slot.offset, slot.offset + slot.numel
        if self.master_mode is HostMaster.BF16:
            self.shadow[a:b].copy_(value.reshape(-1))
            return
        x = value.detach().reshape(-1).to(torch.float32).contiguous()
        new = hilo.split(x, self.shadow[a:b], self.lo[a:b]) + a
        keep = self.ties[(self.ties < a) | (self.ties >= b)]
        self.ties = torch.sort(torch.cat([keep, new])).values

    @property
    def stream_source(self) -> torch.Tensor:
        """What is copied to the device: the bf16 shadow in bf16 mode, else the FP32 master."""
        return self.shadow if self.shadow is not None else self.master


class HostStore:
    """All master weights: one FlatGroup per decoder layer, one for the resident (global) parameters."""

    def __init__(self, layer_shapes: list[list[tuple[str, torch.Size]]], global_shapes: list[tuple[str, torch.Size]],
                 pin: bool, shadow_dtype: torch.dtype | None, master: HostMaster = HostMaster.FP32,
                 grad: GradSlab | None = GradSlab.FLOAT32) -> None:
        self.master_mode, self.grad_mode = master, grad
        self.scratch = None
        if master is not HostMaster.FP32 or grad is not GradSlab.FLOAT32:
            # One layer's FP32 values at a time: the updates run one after another on one thread.
            biggest = max((sum(int(torch.Size(s).numel()) for _, s in shapes) for shapes in layer_shapes), default=0)
            self.scratch = Scratch(biggest, pin, master is not HostMaster.FP32, grad is not GradSlab.FLOAT32)
        self.layers = [FlatGroup(shapes, pin, shadow_dtype, master, grad, self.scratch) for shapes in layer_shapes]
        # The globals (embedding, final norm, head) stay FP32: they are resident on the device, and their
        # gradients arrive at both ends of backward.
        self.globals = FlatGroup(global_shapes, pin, None)

    @property
    def per_layer_update(self) -> bool:
        return self.scratch is not None

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
            for t in (g.master, g.grad, g.shadow, g.lo, g.ties):
                if t is not None:
                    total += t.numel() * t.element_size()
        if self.scratch is not None:
            total += sum(t.numel() * t.element_size() for t in (self.scratch.master, self.scratch.grad)
                         if t is not None)
        return total

    def zero_grad(self) -> None:
        for g in self.groups():
            if g.grad is not None:
                g.grad.zero_()
