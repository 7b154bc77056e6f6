"""Which host buffers are pinned, and exactly how many bytes that locks: one rule for the host store, the
preflight and the planner (plain arithmetic, no torch import, so `megatrain plan` runs it as is).

Only what a DMA copy reads or writes is pinned: each decoder layer's streamed copy (the FP32 master, or its
bf16 shadow in bf16 mode), in FP32 compute the resident parameters' FP32 masters (uploaded after every step;
in bf16 the upload reads its own bf16 staging instead, so the masters stay pageable) and, on CUDA,
the staging gradients land in (the layers' slots, and one for the resident parameters') and, on CUDA with a
compute dtype other than FP32, the resident parameters' upload staging in that dtype (the masters are rounded
into it on the host and it goes up as one DMA: engine/host/resident_upload.py). Gradient slabs,
and the FP32 masters behind a bf16 shadow, are only ever touched by the host: pinning them would lock memory the OS could otherwise page, for nothing.

Every buffer is its own page-aligned mapping, so what it locks is its size rounded up to a page: the
figures below are exact, not estimates (the caching host allocator rounded each block up to a power of
two, up to 2x more).
"""

from __future__ import annotations

PAGE_BYTES = 4096
# Staging slots on CUDA: gradients of the next layers can leave the device while the host still adds an
# earlier layer's into its slab, so the device runs up to this many layers ahead of the host reducer.
STAGING_SLOTS = 3


def mapped_bytes(nbytes: int) -> int:
    """Bytes one buffer of `nbytes` occupies (and locks, when pinned): a whole number of pages, at least one."""
    return max(1, -(-int(nbytes) // PAGE_BYTES)) * PAGE_BYTES


def pinned_bytes(layer_numels: list[int], global_numel: int, stream_itemsize: int, staging: bool,
                 staging_itemsize: int) -> dict[str, int]:
    """Pinned bytes by component. `stream_itemsize`: 4 when layers stream their FP32 master, 2 for a bf16
    shadow; `staging`: whether gradients land in pinned staging (CUDA): slots of the largest layer, and one
    of the resident parameters, in the compute dtype (`staging_itemsize`), and when that is not FP32 the
    resident parameters' upload staging in it too; the resident FP32 masters only when they are what
    is uploaded (`staging_itemsize` 4: FP32 compute). Per-batch buffers (offloaded
    activations, the embedding's row gradients) come on top; they are kept from batch to batch."""
    out = {"streamed layers": sum(mapped_bytes(n * stream_itemsize) for n in layer_numels)}
    if staging_itemsize == 4:  # FP32 compute: the upload copies from the masters themselves
        out["resident masters"] = mapped_bytes(global_numel * 4)
    if staging and layer_numels:
        out["grad staging"] = STAGING_SLOTS * mapped_bytes(max(layer_numels) * staging_itemsize)
    if staging:  # the head's (and final norm's) gradients leave through it, once per micro-batch
        out["resident grad staging"] = mapped_bytes(global_numel * staging_itemsize)
    if staging and staging_itemsize != 4:  # the resident masters rounded to the compute dtype, uploaded each step
        out["resident upload staging"] = mapped_bytes(global_numel * staging_itemsize)
    return out
