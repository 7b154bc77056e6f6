"""Host buffers outside torch's caching host allocator: one page-aligned anonymous mapping each, page-locked
and registered with CUDA (`cudaHostRegister`) when a DMA copy reads or writes it.

Why not `torch.empty(..., pin_memory=True)`: the caching host allocator rounds every block up to a power of
two (a 5.4 GB layer slab locks 8 GiB) and keeps freed blocks for reuse, so what is locked is neither what
the store holds nor what the preflight can count. Here a buffer locks exactly its size rounded up to a
page (costs/pinning.py, mapped_bytes), large buffers ask for transparent huge pages, and registration (the slow
part: the kernel faults in and locks every page) runs on several threads at once.

A failed registration is an error naming how much could be pinned: a streamed buffer left pageable would
turn every asynchronous copy into a synchronous one, silently.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from ...costs.pinning import mapped_bytes

HUGE_PAGE_BYTES = 2 * 2**20  # below this, asking for transparent huge pages gains nothing
Register = Callable[[int, int], None]  # (address, bytes): raises on failure
Unregister = Callable[[int], None]


class PinnedMemoryError(MemoryError):
    """Host memory that must be pinned (it is copied to or from the device) could not be."""


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value
_mappings: weakref.WeakValueDictionary[int, _Mapping] = weakref.WeakValueDictionary()  # by address, while alive


def cuda_register(ptr: int, nbytes: int) -> None:
    """Page-lock [ptr, ptr + nbytes) and map it for the device (cudaHostRegisterDefault)."""
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        clear_cuda_error(cudart)  # not sticky: keep it from surfacing later as some kernel's launch error
        raise RuntimeError(f"cudaHostRegister of {nbytes / 2**30:.2f} GiB failed: {err}")


def clear_cuda_error(cudart: object) -> bool:
    """Reset the CUDA runtime's last error (cudaGetLastError); False when no way to call it was found.

    torch's `cudart()` module binds a few runtime calls, not cudaGetLastError: then it is called in the
    libcudart this process already loaded (never a second copy, whose error state would be another one)."""
    clear = getattr(cudart, "cudaGetLastError", None) or _loaded_cudart_symbol("cudaGetLastError")
    if clear is None:
        return False
    clear()
    return True


def _loaded_cudart_symbol(name: str) -> Callable[[], int] | None:
    major = (torch.version.cuda or "").split(".")[0]
    for lib in (f"libcudart.so.{major}" if major else None, "libcudart.so", None):
        try:
            handle = ctypes.CDLL(lib, mode=os.RTLD_NOLOAD | os.RTLD_LAZY) if lib else ctypes.CDLL(None)
            fn = getattr(handle, name)
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        fn.argtypes = []
        return fn
    return None


_CUDA_REGISTER = cuda_register


def cuda_unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


class _Mapping:
    """Owns one mapping: unregisters (when registered) and unmaps it when the last tensor on it is gone."""

    def __init__(self, nbytes: int, fd: int = -1) -> None:
        self.nbytes = mapped_bytes(nbytes)
        # fd >= 0: a file the node's processes share (engine/host/node_store.py), mapped shared; else private memory.
        flags = mmap.MAP_SHARED if fd >= 0 else mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        ptr = _libc.mmap(None, self.nbytes, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
        if ptr is None or ptr == _MAP_FAILED:
            raise MemoryError(f"mmap of {self.nbytes / 2**30:.2f} GiB failed: {os.strerror(ctypes.get_errno())}")
        self.ptr = ptr
        self.unregister: Unregister | None = None
        if self.nbytes >= HUGE_PAGE_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
            _libc.madvise(ptr, self.nbytes, mmap.MADV_HUGEPAGE)  # advice only: ignored where THP is off

    def __del__(self, _munmap=_libc.munmap) -> None:  # bound now: module globals may be gone at shutdown
        if self.unregister is not None:
            try:
                self.unregister(self.ptr)
            except Exception:  # noqa: BLE001 - interpreter shutdown may have torn CUDA down already
                pass
        _munmap(self.ptr, self.nbytes)


def host_buffer(numel: int, dtype: torch.dtype, fd: int = -1) -> torch.Tensor:
    """A zero-filled, page-aligned host tensor of `numel` elements on its own mapping (not yet pinned); with `fd`
    a view of that file (at least `mapped_bytes` long), shared with every process that maps it."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    owner = _Mapping(numel * itemsize, fd)
    holder = type("_HostBytes", (ctypes.c_ubyte * owner.nbytes,), {}).from_address(owner.ptr)
    holder.owner = owner  # the tensor keeps the holder alive, the holder keeps the mapping
    _mappings[owner.ptr] = owner
    return torch.frombuffer(holder, dtype=torch.uint8)[: numel * itemsize].view(dtype)


class Pinner:
    """Pins host buffers (each a `host_buffer`) with `register`, `threads` at a time, and counts the bytes."""

    def __init__(self, register: Register | None = None, unregister: Unregister | None = None,
                 threads: int = 8) -> None:
        self.register = register or cuda_register
        self.unregister = unregister or cuda_unregister
        self.threads = max(1, threads)
        self.pinned_bytes = 0

    def pin(self, buffers: Sequence[torch.Tensor], what: str = "host buffers") -> None:
        """Pin every buffer or raise PinnedMemoryError (those pinned so far stay pinned until freed)."""
        owners = [_mapping_of(b) for b in buffers]
        todo = sum(o.nbytes for o in owners)
        if self.register is _CUDA_REGISTER:  # the real registration (the tests stand a fake in for it)
            from ..runtime.device_resolution import cuda_unavailable_reason

            why = cuda_unavailable_reason()
            if why is not None:  # no limit to raise: nothing here can pin for a CUDA device
                raise PinnedMemoryError(
                    f"cannot pin {todo / 2**30:.2f} GiB of {what}: pinning is for copies to a CUDA device, and CUDA "
                    f"is not usable here ({why}). Set pin_memory to false (or leave it unset: pinned only on CUDA), "
                    "or run on a machine where CUDA works")
        # The pool's threads register on the caller's device: a thread that never set one would open a CUDA
        # context on GPU 0 (every rank of a node, each on its own GPU, would then also hold one there).
        device = torch.cuda.current_device() if self.register is cuda_register and torch.cuda.is_available() else None

        def one(o: _Mapping) -> BaseException | None:
            try:
                if device is not None and torch.cuda.current_device() != device:
                    torch.cuda.set_device(device)
                self.register(o.ptr, o.nbytes)
            except Exception as exc:  # noqa: BLE001 - reported below with the totals
                return exc
            o.unregister = self.unregister
            return None

        # The first on this thread (it may initialise CUDA), the rest `threads` at a time: the kernel faults in
        # and locks every page, which is what takes the time.
        errors = [one(o) for o in owners[:1]]
        with ThreadPoolExecutor(min(self.threads, max(1, len(owners) - 1))) as pool:
            errors += list(pool.map(one, owners[1:]))
        done = sum(o.nbytes for o, e in zip(owners, errors) if e is None)
        self.pinned_bytes += done
        failed = [e for e in errors if e is not None]
        if failed:
            raise PinnedMemoryError(
                f"could pin only {done / 2**30:.2f} GiB of the {todo / 2**30:.2f} GiB of {what} that are copied "
                f"to or from the device ({self.pinned_bytes / 2**30:.2f} GiB pinned in all; first error: "
                f"{failed[0]}). Raise the locked-memory limit (`ulimit -l unlimited`; in a container "
                "--ulimit memlock=-1), free host memory, use a smaller model, or set pin_memory=False to run "
                "with pageable memory (every host<->device copy then becomes synchronous: much slower)")

    def buffer(self, numel: int, dtype: torch.dtype, what: str) -> torch.Tensor:
        """One new host buffer, pinned."""
        t = host_buffer(numel, dtype)
        self.pin([t], what)
        return t


def _mapping_of(t: torch.Tensor) -> _Mapping:
    owner = _mappings.get(t.untyped_storage().data_ptr())
    if owner is None:
        raise ValueError("only buffers made by pinned.host_buffer can be pinned")
    return owner
