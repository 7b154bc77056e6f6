"""How a host mode holds a layer: one codec per master mode and one per gradient slab, chosen once per group.

A master codec says what a layer's master is made of in host memory (FP32; the bf16 half alone; the exact
hi/lo split), how it is joined into the FP32 `work` the optimizer steps (`unpack`), split back (`pack`), read
and written a parameter at a time, and which buffer streams to the device. A gradient codec says what holds a
layer's gradients (an FP32 slab the Parameters' .grad view; a bf16 slab widened into an FP32 scratch; none: the
optimizer in backward), and how `grad_work` comes to hold the FP32 gradients times the clipping still pending.

The store (store.py) picks both when it builds a group (`master_codec`, `grad_codec`) and never tests a mode
again; the codecs keep no state: the buffers stay the group's, where the fused pass, the spill tier and the
ranks read them. The modes themselves, and what each costs, are megatrain/costs/modes.py's.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from ...costs.modes import GradSlab, HostMaster
from . import hilo
from .pinned import host_buffer
from .rounding import round_stochastic


class Span(Protocol):
    """One parameter's place in its group's flat buffers (store.Slot)."""

    offset: int
    numel: int
    shape: torch.Size


class Held(Protocol):
    """What a master codec reads and writes of a group (store.FlatGroup): its buffers, where they are now (the
    spill tier may move them between calls)."""

    master: torch.Tensor | None
    shadow: torch.Tensor | None
    lo: torch.Tensor | None
    tie_table: torch.Tensor | None
    held_tail: torch.Tensor | None
    work: torch.Tensor
    ties: torch.Tensor
    rounding: torch.Generator | None
    owned: bool


class Grads(Protocol):
    """What a gradient codec reads of a group, or of a range of one (store.GroupRange)."""

    grad: torch.Tensor | None
    grad_work: torch.Tensor | None
    numel: int


class SharedParts(Protocol):
    """A layer's buffers in the node's shared memory (store.SharedLayer)."""

    master: torch.Tensor | None
    shadow: torch.Tensor | None
    lo: torch.Tensor | None
    ties: torch.Tensor | None


class MasterBuffers(NamedTuple):
    """A group's persistent master buffers (None where the mode has none) and the FP32 values its Parameters view."""

    master: torch.Tensor | None
    shadow: torch.Tensor | None
    lo: torch.Tensor | None
    tie_table: torch.Tensor | None
    work: torch.Tensor


class MasterCodec:
    """A master mode's codec, as the FP32 mode has it (the other modes override what differs): an FP32 master and
    the bf16 shadow that streams when the device computes in bf16; the Parameters are the master itself, so there
    is nothing to join or split, and `pack` refreshes the shadow."""

    mode = HostMaster.FP32
    per_layer = False  # the optimizer may step every group at once: the Parameters hold the masters always

    def shared_kinds(self, shadow_dtype: torch.dtype | None) -> list[tuple[str, torch.dtype]]:
        """The (SharedLayer field, dtype) of each persistent buffer a layer keeps in the node's shared memory."""
        return [("master", torch.float32)] + ([("shadow", shadow_dtype)] if shadow_dtype is not None else [])

    def buffers(self, numel: int, shadow_dtype: torch.dtype | None, shared: SharedParts | None,
                scratch: torch.Tensor | None) -> MasterBuffers:
        """A group's master buffers: the node's (`shared`) or fresh zero-filled ones; `scratch`: the store's
        one-layer FP32 working space (None where the mode needs none)."""
        if shared is not None:
            master, shadow = shared.master, shared.shadow
        else:
            master = host_buffer(numel, torch.float32)
            shadow = host_buffer(numel, shadow_dtype) if shadow_dtype is not None else None
        return MasterBuffers(master, shadow, None, None, master)

    def unpack(self, g: Held) -> None:
        """Make `g.work` hold the FP32 master values (here it is the master)."""

    def pack(self, g: Held) -> None:
        """Store `g.work` back as the master; here: the streamed copy refreshed from it."""
        self.refresh(g)

    def refresh(self, g: Held) -> None:
        """Bring the streamed copy in line with a master written in place (a shadow only an FP32 master has,
        written by its owner only)."""
        if g.shadow is not None and g.owned:
            g.shadow.copy_(g.master)

    def read(self, g: Held, s: Span) -> torch.Tensor:
        """A new FP32 tensor with one parameter's master values."""
        return g.master[s.offset: s.offset + s.numel].view(s.shape).clone()

    def write(self, g: Held, s: Span, value: torch.Tensor) -> None:
        """Set one parameter's master values (the shadow is refreshed by the caller, once for many writes)."""
        g.master[s.offset: s.offset + s.numel].view(s.shape).copy_(value)

    def stream_source(self, g: Held) -> torch.Tensor:
        """What is copied to the device: the bf16 shadow when there is one, else the FP32 master."""
        return g.shadow if g.shadow is not None else g.master

    def master_tensors(self, g: Held) -> list[torch.Tensor]:
        """The buffers that hold the master values (what a copy of the weights between ranks moves)."""
        return [g.master]


class Bf16Master(MasterCodec):
    """The bf16 half is the master (the paper's code; not exact): it is what streams, and the Parameters view the
    store's FP32 scratch, filled from it for the update and rounded back (nearest-even, or stochastic where the
    group has a generator)."""

    mode = HostMaster.BF16
    per_layer = True

    def shared_kinds(self, shadow_dtype: torch.dtype | None) -> list[tuple[str, torch.dtype]]:
        return [("shadow", torch.bfloat16)]

    def buffers(self, numel: int, shadow_dtype: torch.dtype | None, shared: SharedParts | None,
                scratch: torch.Tensor | None) -> MasterBuffers:
        # The bf16 half is the master's own storage and what streams: no shadow, no per-step cast.
        shadow = shared.shadow if shared is not None else host_buffer(numel, torch.bfloat16)
        return MasterBuffers(None, shadow, None, None, scratch[:numel])

    def unpack(self, g: Held) -> None:
        g.work.copy_(g.shadow)

    def refresh(self, g: Held) -> None:
        """The master is what streams: no copy to refresh."""

    def pack(self, g: Held) -> None:
        if g.rounding is not None:
            round_stochastic(g.work, g.shadow, g.rounding)
        else:
            g.shadow.copy_(g.work)
        poison(g)

    def read(self, g: Held, s: Span) -> torch.Tensor:
        return g.shadow[s.offset: s.offset + s.numel].float().view(s.shape)

    def write(self, g: Held, s: Span, value: torch.Tensor) -> None:
        g.shadow[s.offset: s.offset + s.numel].copy_(value.reshape(-1))

    def stream_source(self, g: Held) -> torch.Tensor:
        return g.shadow

    def master_tensors(self, g: Held) -> list[torch.Tensor]:
        return [g.shadow]


class HiloMaster(Bf16Master):
    """The exact split (hilo.py): the bf16 hi half streams, the int16 lo half and the tie positions stay; joined
    into the FP32 scratch for the update and split back bit for bit."""

    mode = HostMaster.HILO

    def shared_kinds(self, shadow_dtype: torch.dtype | None) -> list[tuple[str, torch.dtype]]:
        return [("shadow", torch.bfloat16), ("lo", torch.int16), ("ties", torch.int64)]

    def buffers(self, numel: int, shadow_dtype: torch.dtype | None, shared: SharedParts | None,
                scratch: torch.Tensor | None) -> MasterBuffers:
        if shared is not None:
            return MasterBuffers(None, shared.shadow, shared.lo, shared.ties, scratch[:numel])
        return MasterBuffers(None, host_buffer(numel, torch.bfloat16), host_buffer(numel, torch.int16), None,
                             scratch[:numel])

    def unpack(self, g: Held) -> None:
        hilo.join(g.shadow, g.lo, g.ties, g.work)

    def pack(self, g: Held) -> None:
        with hilo.poisoning(g.work) as poisoned:  # the NaN fill, done by the split as it reads
            g.ties = hilo.split(g.work, g.shadow, g.lo)
        if not poisoned:
            poison(g)

    def read(self, g: Held, s: Span) -> torch.Tensor:
        a, b = s.offset, s.offset + s.numel
        ties = g.ties[(g.ties >= a) & (g.ties < b)] - a
        return hilo.join(g.shadow[a:b], g.lo[a:b], ties, torch.empty(s.numel)).view(s.shape)

    def write(self, g: Held, s: Span, value: torch.Tensor) -> None:
        a, b = s.offset, s.offset + s.numel
        x = value.detach().reshape(-1).to(torch.float32).contiguous()
        new = hilo.split(x, g.shadow[a:b], g.lo[a:b]) + a
        keep = g.ties[(g.ties < a) | (g.ties >= b)]
        g.ties = torch.sort(torch.cat([keep, new])).values

    def master_tensors(self, g: Held) -> list[torch.Tensor]:
        # A private tie list is not a fixed size: only a shared table moves with the halves.
        return [g.shadow, g.lo] + ([g.tie_table] if g.tie_table is not None else [])


class LoadedBf16(Bf16Master):
    """A frozen layer loaded in bf16 (engine/model/trainable.py): its weights held as loaded, 2 bytes each, and
    nothing else: no FP32 master (nothing updates it), no scratch; the bf16 buffer is what streams (widened to an
    FP32 device buffer where the device computes in FP32: the same values) and what its Parameters view."""

    per_layer = False  # never unpacked or packed: no optimizer holds its parameters

    def buffers(self, numel: int, shadow_dtype: torch.dtype | None, shared: SharedParts | None,
                scratch: torch.Tensor | None) -> MasterBuffers:
        held = shared.shadow if shared is not None else host_buffer(numel, torch.bfloat16)
        return MasterBuffers(None, held, None, None, held)

    def unpack(self, g: Held) -> None:
        """The weights are the Parameters' already."""

    def pack(self, g: Held) -> None:
        """Nothing changed them: no rounding, no poisoning (the Parameters view the weights themselves)."""


LOADED_BF16 = LoadedBf16()


class FrozenTail(MasterCodec):
    """The resident parameters (embedding, final norm, head, PEFT's adapters) whose frozen ones loaded in bf16 end
    the group (engine/model/placement.py orders them last): an FP32 master for the rest, and those held as loaded,
    2 bytes each, in `held_tail` (what their Parameters view), as a frozen layer is (LoadedBf16). Nothing updates
    the tail: only reads and writes of a parameter (a load, the engine's state_dict) reach it."""

    @staticmethod
    def _tail(g: Held, s: Span) -> torch.Tensor | None:
        m = g.master.numel()
        return g.held_tail[s.offset - m: s.offset - m + s.numel] if s.offset >= m else None

    def read(self, g: Held, s: Span) -> torch.Tensor:
        tail = self._tail(g, s)
        return super().read(g, s) if tail is None else tail.float().view(s.shape)

    def write(self, g: Held, s: Span, value: torch.Tensor) -> None:
        tail = self._tail(g, s)
        if tail is None:
            super().write(g, s, value)
        else:
            tail.copy_(value.reshape(-1))

    def master_tensors(self, g: Held) -> list[torch.Tensor]:
        return [g.master, g.held_tail]


FROZEN_TAIL = FrozenTail()


def poison(g: Held) -> None:
    """The scratch is shared by every layer: whoever reads a layer's Parameters outside its update (instead of
    read_slot / the engine's state_dict) gets NaN, never another layer's plausible-looking weights."""
    g.work.fill_(float("nan"))


class GradCodec:
    """A gradient slab mode's codec, as the FP32 slab has it (the other modes override what differs): an FP32 slab
    that the Parameters' .grad view: the optimizer reads it in place; a clip still pending on it
    (folded into the update) scales it in place, as a clip_grad_norm_ that left the scaling to the update would
    have."""

    mode: GradSlab | None = GradSlab.FLOAT32
    per_layer = False  # the slab is the FP32 gradient: no scratch, no per-layer widening

    def buffers(self, numel: int, scratch: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(the persistent slab or None, the FP32 gradients the optimizer reads) of a group this rank owns."""
        grad = host_buffer(numel, torch.float32)
        return grad, grad

    def linked(self, g: Grads) -> torch.Tensor | None:
        """The buffer the Parameters' .grad are views of between steps (None: they have no .grad)."""
        return g.grad

    def load(self, g: Grads, coefs: list[float]) -> None:
        """Make `g.grad_work` hold the FP32 gradients times `coefs` (the clipping still pending on them)."""
        if g.grad_work is None or not coefs:
            return  # another rank's layer; or nothing pending
        scale_tiles(g, coefs, widen=False)


class Bf16Grads(GradCodec):
    """A bf16 slab (exact with bf16 compute and one micro-batch per step): widened into the FP32 scratch at the
    update, the pending clip applied there in FP32 (the same products as scaling an FP32 slab of the same
    values; never a scaling in bf16, which would round)."""

    mode = GradSlab.BFLOAT16
    per_layer = True

    def buffers(self, numel: int, scratch: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor]:
        return host_buffer(numel, torch.bfloat16), scratch[:numel]

    def linked(self, g: Grads) -> torch.Tensor | None:
        return None  # only the per-layer update reads gradients, from grad_work

    def load(self, g: Grads, coefs: list[float]) -> None:
        if g.grad_work is None:
            return  # another rank's layer
        scale_tiles(g, coefs, widen=True)


class NoGrads(Bf16Grads):
    """No slab (optimizer in backward): each layer's staged gradients are put in the FP32 scratch as they come,
    and updated at once; there is nothing to widen and no clip (no global norm exists)."""

    mode = None

    def buffers(self, numel: int, scratch: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor]:
        return None, scratch[:numel]

    def load(self, g: Grads, coefs: list[float]) -> None:
        """The staged gradients stay as they are."""


def scale_tiles(g: Grads, coefs: list[float], widen: bool) -> None:
    """`g.grad_work` (widened from `g.grad` first when `widen`) times each of `coefs`, a cache-sized tile at a
    time: the scaling reads the widened values from cache, not memory."""
    for s in range(0, g.numel, hilo.TILE):
        w = g.grad_work[s: s + hilo.TILE]
        if widen:
            w.copy_(g.grad[s: s + hilo.TILE])
        for c in coefs:
            w.mul_(c)


_MASTERS: dict[HostMaster, MasterCodec] = {c.mode: c for c in (MasterCodec(), Bf16Master(), HiloMaster())}
_GRADS: dict[GradSlab | None, GradCodec] = {c.mode: c for c in (GradCodec(), Bf16Grads(), NoGrads())}


def master_codec(mode: HostMaster) -> MasterCodec:
    """The codec of a master mode."""
    try:
        return _MASTERS[mode]
    except (KeyError, TypeError):
        raise ValueError(f"host master mode {mode!r} has no codec; use one of "
                         f"{', '.join(repr(m.value) for m in HostMaster)}") from None


def grad_codec(mode: GradSlab | None) -> GradCodec:
    """The codec of a gradient slab mode (None: no slab, the optimizer in backward)."""
    try:
        return _GRADS[mode]
    except (KeyError, TypeError):
        raise ValueError(f"gradient slab mode {mode!r} has no codec; use one of "
                         f"{', '.join(repr(m.value) for m in GradSlab)} or None (no slab)") from None
