"""The resident parameters' (embedding, final norm, LM head) upload after each step, when the device computes in a
dtype other than their FP32 masters' (CUDA, bf16).

`device_bf16.copy_(host_fp32, non_blocking=True)` converts on the host first: torch makes a full-size pageable
bf16 temporary every step, and a copy from pageable memory holds the calling thread until it is done. Here the
masters are rounded once per step into one pinned buffer of the compute dtype (round-to-nearest-even, the same
bits as `.to(dtype)`), and that buffer goes up in one asynchronous copy per tensor, 2 B/element, on a copy
stream of its own. The buffer is refilled only after the previous step's copy read it (its event, waited for on
the host: a step later, it has long finished).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..runtime.stream import CudaEvent
from .store import FlatGroup, HostStore


def upload_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """One host->device copy, queued on the current stream (a pinned source of the destination's dtype: a DMA)."""
    dst.copy_(src, non_blocking=True)


class ResidentUpload:
    """Pinned staging of the resident parameters in the compute dtype, and their upload on a copy stream."""

    def __init__(self, store: HostStore, targets: Sequence[torch.Tensor], dtype: torch.dtype,
                 device: torch.device, watchdog_s: float) -> None:
        group = store.globals
        if group.master is None or group.master.dtype == dtype:
            raise ValueError(f"a staged upload converts the FP32 masters to another dtype, got {dtype} for "
                             f"masters of {None if group.master is None else group.master.dtype}")
        self.group: FlatGroup = group
        self.targets = list(targets)
        self.device = device
        self.watchdog_s = watchdog_s
        # Pinned up front with the store (costs/pinning.py counts it: "resident upload staging").
        self.staging = store.buffer(group.numel, dtype, "resident parameters' upload staging")
        self._views = [group.view(self.staging, s) for s in group.slots]
        self._stream = torch.cuda.Stream(device=device)
        self._copied: CudaEvent | None = None  # the last upload's copies, done: the staging may be refilled
        self.nbytes = self.staging.numel() * self.staging.element_size()

    def _wait_free(self) -> None:
        if self._copied is not None:
            self._copied.host_wait(self.watchdog_s)

    def run(self) -> None:
        """Round the masters into the staging (after its last copy finished), then queue the upload: after the
        compute queued so far (it may still read the old values), and before any compute queued after this."""
        self._wait_free()
        self.staging.copy_(self.group.master)  # FP32 -> compute dtype on the host: round-to-nearest-even
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream), torch.no_grad():
            for dst, src in zip(self.targets, self._views):
                upload_copy(dst.detach(), src)
            done = torch.cuda.Event()
            done.record(self._stream)
        compute.wait_event(done)  # queued on the device: the host does not wait here
        self._copied = CudaEvent(done, "resident parameters' upload")
