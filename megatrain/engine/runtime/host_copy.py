"""Small host tensors (a batch's ids and masks, the loss's token indices) onto the device without the host
waiting for it.

`t.to("cuda", non_blocking=True)` from pageable memory is not asynchronous: the driver stages the bytes through
its own pinned buffer and returns only when the copy is done, behind whatever the stream had queued, so once per
micro-batch the launch thread would wait for the device. From pinned memory the copy is queued and the call
returns. torch's caching pinned allocator suits these tensors (a few KB, reused once their copy is done; the
large buffers of the store are pinned by engine/host/pinned.py instead).
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, dev: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`t` on `dev` (as `dtype`, converted on the host first), queued without blocking the host on a CUDA device."""
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if dev.type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(dev, non_blocking=True)
