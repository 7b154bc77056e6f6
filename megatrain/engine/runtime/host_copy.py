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


def _pinned_empty(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, pin_memory=True)


class HostCopy:
    """A small device tensor's copy into pinned host memory, queued on the current stream: the host does not wait
    for it, and `wait()` later waits for that copy alone (its event), not for the work queued after it. For values
    the host needs from a device batch (its ids' rows for the embedding's gradient, the batch checks' reductions)
    a micro-batch later than they were queued: by then the copy has long finished, where reading them at once
    (.tolist(), torch.unique on the device) would make the host wait for the device's whole queue."""

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = _pinned_empty(t.shape, t.dtype)
        self.tensor.copy_(t, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(t.device))

    def wait(self) -> torch.Tensor:
        self._event.synchronize()
        return self.tensor


def to_host(t: torch.Tensor) -> HostCopy | torch.Tensor:
    """`t` on the host: queued (a HostCopy, `wait()` for it) from a CUDA device, `t` itself from the host's."""
    if t.device.type == "cuda":
        return HostCopy(t)
    return t.cpu()


def host_value(t: HostCopy | torch.Tensor) -> torch.Tensor:
    """What to_host gave, in host memory (a queued copy waited for)."""
    return t.wait() if isinstance(t, HostCopy) else t
