"""Background samplers: peak host RSS, and PCIe traffic from NVML counters on CUDA machines."""

from __future__ import annotations

import resource
import sys
import threading
import time

import psutil


def peak_rss_bytes() -> int:
    """The kernel's resident high-water mark of this process image: VmHWM on Linux. Not ru_maxrss: that one
    survives execve, so a child started by fork + exec reports at least its parent's RSS at the fork
    (measured: a child of an 800 MB parent read 813 MB while its own image peaked at 14 MB)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss * (1 if sys.platform == "darwin" else 1024)  # bytes on macOS, KiB elsewhere


class RssSampler:
    """Peak resident set size of this process.

    Sampling alone misses short spikes, so the result is also checked against the kernel's
    high-water mark (peak_rss_bytes), which is exact but counts the whole life of the process image;
    the caller takes a baseline before building the model so bytes/param reflect the training state.
    """

    def __init__(self, interval_s: float = 0.01) -> None:
        self.interval_s = interval_s
        self._proc = psutil.Process()
        self._peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def rss(self) -> int:
        return self._proc.memory_info().rss

    def start(self) -> RssSampler:
        self._peak = self.rss()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._peak = max(self._peak, self.rss())

    def stop(self) -> int:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        return self.peak()

    def peak(self) -> int:
        return max(self._peak, self.rss(), peak_rss_bytes())


class NvmlPcieSampler:
    """PCIe rx/tx throughput of one GPU from NVML, sampled in the background.

    NVML reports KB/s averaged over its own ~20 ms window, so the sampler integrates rate x
    interval between calls; `bytes_between(t0, t1)` gives host->device (rx) and device->host (tx)
    bytes for a timed window. Unavailable (no pynvml, no driver): `available` is False.
    """

    def __init__(self, device_index: int = 0, interval_s: float = 0.02) -> None:
        self.interval_s = interval_s
        self.available = False
        self._samples: list[tuple[float, float, float]] = []  # (t, rx B/s, tx B/s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = self._handle_for(pynvml, device_index)
            pynvml.nvmlDeviceGetPcieThroughput(self._handle, pynvml.NVML_PCIE_UTIL_RX_BYTES)
            self.available = True
        except Exception:  # noqa: BLE001 - any NVML failure just means no counters
            self.available = False

    @staticmethod
    def _handle_for(nv, device_index: int):
        # CUDA and NVML number GPUs differently under CUDA_VISIBLE_DEVICES; the UUID is shared.
        try:
            import torch

            uuid = str(torch.cuda.get_device_properties(device_index).uuid)
            return nv.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        except Exception:  # noqa: BLE001
            return nv.nvmlDeviceGetHandleByIndex(device_index)

    def start(self) -> NvmlPcieSampler:
        if self.available:
            self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        nv, h = self._nvml, self._handle
        while not self._stop.is_set():
            try:
                rx = nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_RX_BYTES) * 1024.0
                tx = nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_TX_BYTES) * 1024.0
            except Exception:  # noqa: BLE001
                return
            self._samples.append((time.perf_counter(), rx, tx))
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    def bytes_between(self, t0: float, t1: float) -> tuple[float, float] | None:
        """(h2d bytes, d2h bytes) in [t0, t1], from the mean sampled rate; None without samples."""
        inside = [(rx, tx) for t, rx, tx in list(self._samples) if t0 <= t <= t1]
        if not inside:
            return None
        rx = sum(s[0] for s in inside) / len(inside)
        tx = sum(s[1] for s in inside) / len(inside)
        return rx * (t1 - t0), tx * (t1 - t0)
