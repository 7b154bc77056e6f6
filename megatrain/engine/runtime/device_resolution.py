"""Which device the engine computes on, and why CUDA is not usable when it is not.

A CUDA build of torch (what a plain `pip install torch` gives) reports `cuda` as its accelerator even on a
machine without a driver or a GPU; taken at its word, the engine would fail later with an error that points
the wrong way (a pinning limit, "Found no NVIDIA driver" mid-construction). Every face (the engine, the
DeepSpeed and Accelerate faces, `megatrain train`, the metrics) resolves its device here, once.
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch

log = logging.getLogger("megatrain")
_noted: set[str] = set()  # the CPU fallback is said once per process and cause


def cuda_unavailable_reason() -> str | None:
    """Why CUDA cannot be used here (the cause and its fix), or None when it can."""
    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return (f"this torch ({torch.__version__}) is built without CUDA; install a CUDA build of torch "
                "(https://pytorch.org/get-started/locally/)")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU; unset it or name the GPUs to use"
    if not _driver_loads():
        return ("no NVIDIA driver: torch is a CUDA build, but libcuda.so.1 cannot be loaded; install the NVIDIA "
                "driver (in a container: start it with the GPUs passed in, e.g. `docker run --gpus all`)")
    return ("no usable GPU: the NVIDIA driver is installed but finds no device torch can use "
            "(torch.cuda.device_count() is 0); check `nvidia-smi`, CUDA_VISIBLE_DEVICES and, in a container, "
            "that the GPUs are passed in (`--gpus all`)")


def _driver_loads() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def _unusable_reason(dev: torch.device) -> str | None:
    if dev.type == "cuda":
        return cuda_unavailable_reason()
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
    why = _unusable_reason(acc)
    if why is not None:
        if why not in _noted:
            _noted.add(why)
            log.warning("megatrain: training on the CPU: torch's accelerator is %s, but %s", acc.type, why)
        return torch.device("cpu")
    return acc
