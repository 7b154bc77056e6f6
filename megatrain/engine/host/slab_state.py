"""What the job that writes a layer's gradient slab knows about it, kept so the step need not read the slab again.

- fresh: the slab holds no gradient since zero_grad() (it is logically zero, whatever its bytes): the next
  reduction writes 0 + g instead of adding g, so zero_grad() makes no pass over the slabs. 0 + g, not a plain
  copy: a -0 gradient lands as +0, the bits a zeroed slab plus g holds. A reader that needs the values of a
  slab no backward wrote (a step right after zero_grad) zeroes it first (`zero_if_fresh`).
- the slab's L2 norm, computed by the reduction with its add (for the last backward before a step: the engine's
  `measure`), with the slab's version counter then. torch bumps that counter on every in-place write through
  any view of the slab (a user scaling `.grad`, clip_grad_value_, the average across ranks, a clip), so the
  cached norm is used only while the slab is what it was measured from; otherwise the step reads the slab as
  before. Every slab norm is `slab_norm`'s: torch's norm of each fixed chunk of the slab (reduce_kernel.CHUNK,
  whatever the thread count; a bf16 slab widened first), the chunks' norms combined by torch's norm of them (a
  norm of norms, as across slabs). The one-pass kernel measures the same chunks as it writes them, so a cached
  norm has the same bits as one read from the slab later, on any number of threads.
  Not seen: writes that bypass torch's in-place ops (`.grad.data.mul_()`, which has its own counter, or a
  NumPy view); call `invalidate()` after such writes (Engine.grads_written does).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import reduce_kernel

if TYPE_CHECKING:
    from .store import HostStore


@dataclass
class PartsAdd:
    """A reduction's add (`add(overwrite)`), with the gradients it adds as (offset in the slab, tensor) pairs: a
    caller makes one only where the one-pass kernel pays (reduce_kernel.pays). A None gradient: that parameter got
    none (an expert no token was routed to): its range of the slab is left as it is, or zeroed on a first write."""

    add: Callable[[bool], None]
    parts: list[tuple[int, torch.Tensor | None]]

    def __call__(self, overwrite: bool) -> None:
        self.add(overwrite)


class SlabState:
    def __init__(self, num_layers: int) -> None:
        # Off until the engine knows its own pipeline writes every layer's slab (a shared host store's reductions
        # to the owner add into slabs on another thread, unaware of these flags: those slabs are zeroed as before).
        self.overwrite = False
        self.measure = True  # whether reductions queued now compute their slab's norm
        self.fresh = [False] * num_layers
        self._norms: list[tuple[torch.Tensor, int] | None] = [None] * num_layers
        self.tally = reduce_kernel.Tally()  # gradient elements the reductions added, and skipped (no gradient)

    def reduce(self, i: int, slab: torch.Tensor, add: Callable[[bool], None], measure: bool) -> None:
        """Run a reduction into layer i's `slab` on the calling (host) thread: `add(overwrite)`, then its norm if
        `measure` (the value of `self.measure` when the reduction was queued). An `add` that is a `PartsAdd`
        also names its gradients, for the one-pass kernel (reduce_kernel.py) where it applies: then a part
        without a gradient, or a block of zeros in one, costs no add (`self.tally` counts them)."""
        first = self.overwrite and self.fresh[i]
        self._norms[i] = None
        parts = add.parts if isinstance(add, PartsAdd) else None
        lib = reduce_kernel.kernel() if parts is not None and reduce_kernel.usable(slab, parts) else None
        if lib is not None:
            # On this thread's torch count; the norm combined from the chunks' as slab_norm combines them: the bits
            # of add, then slab_norm.
            norm, _ = reduce_kernel.reduce_and_norm(lib, slab, parts, first, None, measure, self.tally)
            self.fresh[i] = False
            if measure:
                self._norms[i] = (norm, slab._version)
            return
        add(first)
        self.fresh[i] = False
        if parts is not None:
            absent = sum(hi - lo for lo, hi, g in reduce_kernel.extents(parts, slab.numel()) if g is None)
            self.tally.skipped += absent
            self.tally.absent += absent
            self.tally.reduced += slab.numel() - absent
        else:
            self.tally.reduced += slab.numel()
        if measure:
            self._norms[i] = (slab_norm(slab), slab._version)

    def zero(self, i: int, slab: torch.Tensor) -> None:
        """zero_grad() of layer i's slab: a flag when the next reduction overwrites, else the zeroing pass."""
        self._norms[i] = None
        if self.overwrite:
            self.fresh[i] = True
        else:
            slab.zero_()

    def zero_if_fresh(self, i: int, slab: torch.Tensor) -> None:
        """Make a fresh slab's bytes zero (before a reader that takes its values, not its norm)."""
        if self.fresh[i]:
            slab.zero_()
            self.fresh[i] = False

    def norm(self, i: int, slab: torch.Tensor) -> torch.Tensor | None:
        """Layer i's slab norm without reading it (a fresh slab's is 0), or None if none is known to hold."""
        if self.fresh[i]:
            return torch.zeros((), dtype=torch.float32)
        cached = self._norms[i]
        if cached is not None and cached[1] == slab._version:
            return cached[0]
        return None

    def invalidate(self) -> None:
        """Forget every cached norm (the slabs were written in a way their version counters do not show)."""
        self._norms = [None] * len(self._norms)


def slab_norm(slab: torch.Tensor) -> torch.Tensor:
    """A gradient slab's L2 norm (a 0-dim FP32 tensor), the same bits however many threads compute it: torch's norm
    of each reduce_kernel.CHUNK-element chunk (row norms, on the caller's torch threads), the chunks' norms
    combined by reduce_kernel.combine; what the one-pass kernel measures as it writes the slab
    (reduce_kernel.reduce_and_norm). A bf16 slab is widened first; a slab of at most one chunk has
    torch.linalg.vector_norm's bits."""
    x = (slab if slab.dtype == torch.float32 else slab.float()).reshape(-1)
    c, n = reduce_kernel.CHUNK, x.numel()
    whole = n - n % c
    parts = [torch.linalg.vector_norm(x[:whole].view(-1, c), dim=1)] if whole else []
    if n > whole or not n:
        parts.append(torch.linalg.vector_norm(x[whole:]).reshape(1))
    return reduce_kernel.combine(parts[0] if len(parts) == 1 else torch.cat(parts))


def landed_norms(store: HostStore, slabs: SlabState, clip_pending: bool) -> list[torch.Tensor | None]:
    """Per slab of `store` that has one (its layers', then the resident parameters'), the norm its reduction
    measured if it still holds, else None (read it). With a clip pending on the slabs (bf16, or folded into the
    update) only a fresh slab's zero holds: the measured norms are of the unscaled values."""
    out: list[torch.Tensor | None] = []
    for i, g in enumerate(store.layers):
        if g.grad is not None:
            out.append(slabs.norm(i, g.grad) if slabs.fresh[i] or not clip_pending else None)
    return [*out, None]  # the resident parameters' slab: read (its adds come from several jobs per backward)
