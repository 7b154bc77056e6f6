"""Which device the engine computes on, and why CUDA is not usable when it is not.

A CUDA build of torch (what a plain `pip install torch` gives) reports `cuda` as its accelerator even on a
machine without a driver or a GPU; taken at its word, the engine would fail later with an error that points
the wrong way (a pinning limit, "Found no NVIDIA driver" mid-construction). Every face (the engine, the
DeepSpeed and Accelerate faces, `megatrain train`, the metrics) resolves its device here, once.

A machine with a GPU (a device node, or a driver that counts devices) where torch still cannot initialise CUDA
is not a CPU machine: most often a driver older than the CUDA the wheel was built for (torch then reports no
GPU). Training on the CPU there would run orders of magnitude slower after one log line, so it is refused, with
torch's own reason and the fix, unless the user asks for device="cpu".
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import warnings

import torch

log = logging.getLogger("megatrain")
_noted: set[str] = set()  # the CPU fallback is said once per process and cause


class CudaInitError(RuntimeError):
    """This machine has a GPU but torch cannot initialise CUDA (a driver/runtime mismatch, most often)."""


def cuda_unavailable_reason() -> str | None:
    """Why CUDA cannot be used here (the cause and its fix), or None when it can."""
    return _cuda_state()[0]


def _cuda_state() -> tuple[str | None, bool]:
    """(why CUDA cannot be used here, or None; whether the machine has a GPU torch failed to initialise)."""
    if torch.cuda.is_available():
        return None, False
    reason = _unavailable_reason()
    if reason is not None:
        return reason, False
    return _mismatch_reason(), True


def _unavailable_reason() -> str | None:
    """Why CUDA cannot be used on a machine without a GPU for it; None where there is one (a device node, or a
    driver that counts devices) that torch failed to initialise."""
    if torch.version.cuda is None:
        return (f"this torch ({torch.__version__}) is built without CUDA; install a CUDA build of torch "
                "(https://pytorch.org/get-started/locally/)")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU; unset it or name the GPUs to use"
    if _device_nodes() or _driver_devices() > 0:
        return None
    if not _driver_loads():
        return ("no NVIDIA driver: torch is a CUDA build, but libcuda.so.1 cannot be loaded; install the NVIDIA "
                "driver (in a container: start it with the GPUs passed in, e.g. `docker run --gpus all`)")
    return ("no usable GPU: the NVIDIA driver is installed but finds no device torch can use "
            "(torch.cuda.device_count() is 0); check `nvidia-smi`, CUDA_VISIBLE_DEVICES and, in a container, "
            "that the GPUs are passed in (`--gpus all`)")


def _mismatch_reason() -> str:
    """A GPU is here and torch cannot initialise CUDA: torch's own reason, the driver's CUDA and the fix."""
    torch_says = _torch_init_error() or "torch.cuda.is_available() is False"
    drv = _driver_cuda_version()
    nodes = _device_nodes()
    seen = f"device node {nodes[0]}" if nodes else "the NVIDIA driver counts GPUs"
    if drv is None:
        driver = "libcuda.so.1 (the driver's library) cannot be loaded"
        fix = ("install the NVIDIA driver's user-space libraries (in a container: start it with the NVIDIA "
               "runtime, e.g. `docker run --gpus all`)")
    elif drv < _cuda_number(torch.version.cuda):
        driver = f"the NVIDIA driver supports CUDA up to {drv // 1000}.{drv % 1000 // 10}, older than torch's"
        fix = (f"upgrade the NVIDIA driver to one that supports CUDA {torch.version.cuda}, or install a torch wheel "
               f"built for CUDA {drv // 1000}.{drv % 1000 // 10} or older (https://pytorch.org/get-started/locally/)")
    else:
        driver = f"the NVIDIA driver supports CUDA up to {drv // 1000}.{drv % 1000 // 10}"
        fix = ("check `nvidia-smi` (a GPU in a bad state, a driver reload pending), CUDA_VISIBLE_DEVICES and that "
               "this user may open the /dev/nvidia* nodes")
    return (f"this machine has a GPU ({seen}) but torch {torch.__version__}, built for CUDA {torch.version.cuda}, "
            f"cannot initialise it: {torch_says}; {driver}. Fix: {fix}")


def _cuda_number(version: str | None) -> int:
    """"12.8" as cuDriverGetVersion writes it (12080); 0 where torch names none."""
    try:
        major, minor = (version or "").split(".")[:2]
        return 1000 * int(major) + 10 * int(minor)
    except ValueError:
        return 0


def _torch_init_error() -> str | None:
    """torch's own reason it cannot initialise CUDA (the error of its initialisation, or the warning its device
    count gives), one line."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.init()
    except Exception as exc:  # torch's initialisation error is what the user needs to read
        return " ".join(str(exc).split())
    for w in caught:
        if "CUDA initialization" in str(w.message):
            return " ".join(str(w.message).split())
    return None


def _device_nodes() -> list[str]:
    return sorted(glob.glob("/dev/nvidia[0-9]*"))


def _libcuda() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def _driver_loads() -> bool:
    return _libcuda() is not None


def _driver_devices() -> int:
    """GPUs the driver itself counts (cuInit, cuDeviceGetCount), whatever torch's runtime makes of them; 0 without
    a driver."""
    lib = _libcuda()
    n = ctypes.c_int(0)
    try:
        if lib is None or lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(n)) != 0:
            return 0
    except AttributeError:
        return 0
    return n.value


def _driver_cuda_version() -> int | None:
    """The newest CUDA the driver supports (cuDriverGetVersion: 1000 x major + 10 x minor); None without one."""
    lib = _libcuda()
    v = ctypes.c_int(0)
    try:
        if lib is None or lib.cuDriverGetVersion(ctypes.byref(v)) != 0:
            return None
    except AttributeError:
        return None
    return v.value


def _unusable_reason(dev: torch.device) -> str | None:
    if dev.type == "cuda":
        return _cuda_state()[0]
    backend = getattr(torch, dev.type, None)
    if dev.type != "cpu" and not (hasattr(backend, "is_available") and backend.is_available()):
        return f"torch reports no usable {dev.type} device"
    return None


def resolve_device(name: str | None) -> torch.device:
    """The torch device `name` names (refused, with the cause and the fix, if it is not usable here), or with
    None the accelerator when it is usable, else the CPU (one log line says why an accelerator was passed over).
    """
    if name is not None:
        # Refused here, before the engine takes the model: torch would only fail later, mid-construction.
        try:
            dev = torch.device(name)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device={name!r} is not a torch device such as 'cuda', 'cuda:0' or 'cpu' ({e})") from e
        if dev.type == "meta":
            raise ValueError(f"device={name!r}: the meta device holds no data; use 'cpu' or 'cuda'")
        why = _unusable_reason(dev)
        if why is not None:
            raise ValueError(f"device={name!r} is not usable here: {why}; or set device to 'cpu' (or leave it "
                             "unset: the accelerator when it is usable, else the CPU)")
        backend = getattr(torch, dev.type, None)
        if dev.index is not None and hasattr(backend, "device_count") and dev.index >= backend.device_count():
            raise ValueError(f"device={name!r}: only {backend.device_count()} {dev.type} device(s) present")
        return dev
    acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    if acc is None:
        return torch.device("cpu")
    why, has_gpu = _cuda_state() if acc.type == "cuda" else (_unusable_reason(acc), False)
    if has_gpu:
        raise CudaInitError(f"{why}; or set device='cpu' to train on the CPU on purpose")
    if why is not None:
        if why not in _noted:
            _noted.add(why)
            log.warning("megatrain: training on the CPU: torch's accelerator is %s, but %s", acc.type, why)
        return torch.device("cpu")
    return acc
