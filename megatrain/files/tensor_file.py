"""A safetensors file read one tensor at a time, with plain reads straight into the caller's memory.

Loading is where a model that barely fits in host memory would otherwise be held twice: reading a whole
checkpoint before copying it into the host store, or mapping it (safetensors' own reader mmaps the file,
and every page a copy touches stays in the process's resident set while the mapping lives). Here each
tensor is read with pread(2) into the tensor it belongs in (`read_into`: a master's view in the store, an
optimizer state tensor), or into a new tensor of its own (`[name]`) that the caller keeps or drops; the file
itself only passes through the page cache, which the kernel reclaims and RSS does not count.

The file is opened once; everything read comes from that open file, even if the path is replaced meanwhile.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_CHUNK = 64 << 20  # bytes per read call: bounded, and far below pread's 2 GiB limit
_HASH_CHUNK = 1 << 20


class TensorFile(Mapping[str, torch.Tensor]):
    """The tensors of one safetensors file, by name; `tf[name]` reads that tensor (the last one read is kept,
    so asking for its shape and then its values reads it once)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            head = os.pread(self._fd, 8, 0)
            if len(head) < 8:
                raise ValueError(f"{self.path}: too short to be a safetensors file")
            n = int.from_bytes(head, "little")
            header = json.loads(os.pread(self._fd, n, 8))
        except BaseException:
            os.close(self._fd)
            raise
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._base = 8 + n
        self._entries: dict[str, tuple[torch.dtype, torch.Size, int, int]] = {}
        for name, e in header.items():
            if e["dtype"] not in _DTYPES:
                raise ValueError(f"{self.path}: tensor {name!r} has dtype {e['dtype']}, which this reader does not know")
            start, end = e["data_offsets"]
            self._entries[name] = (_DTYPES[e["dtype"]], torch.Size(e["shape"]), start, end)
        self._last: tuple[str, torch.Tensor] | None = None
        self._scratch: torch.Tensor | None = None  # read_transient's buffer

    # -- Mapping ------------------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> torch.Tensor:
        if self._last is not None and self._last[0] == name:
            return self._last[1]
        self._last = None  # dropped before the next is read: one tensor's worth held at a time
        dtype, shape, _, _ = self._entry(name)
        out = torch.empty(shape, dtype=dtype)
        self.read_into(name, out)
        self._last = (name, out)
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    # -- reading ------------------------------------------------------------------------------------------
    def _entry(self, name: str) -> tuple[torch.dtype, torch.Size, int, int]:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"{self.path} holds no tensor {name!r}") from None

    def dtype(self, name: str) -> torch.dtype:
        return self._entry(name)[0]

    def shape(self, name: str) -> torch.Size:
        return self._entry(name)[1]

    def read_into(self, name: str, out: torch.Tensor) -> torch.Tensor:
        """Read tensor `name` into `out` (a CPU tensor of its shape): in place when `out` is contiguous and of the
        file's dtype, else through one tensor-sized buffer converted by `copy_`. Returns `out`."""
        dtype, shape, start, end = self._entry(name)
        if tuple(out.shape) != tuple(shape):
            raise ValueError(f"{self.path}: {name} has shape {tuple(shape)}, the destination {tuple(out.shape)}")
        if out.device.type != "cpu":
            raise ValueError(f"{name}: read_into writes host tensors only, got one on {out.device}")
        if out.dtype != dtype or not out.is_contiguous():
            out.copy_(self.read_into(name, torch.empty(shape, dtype=dtype)))
            return out
        nbytes = end - start
        if nbytes != out.numel() * out.element_size():
            raise ValueError(f"{self.path}: {name} spans {nbytes} bytes, not {out.numel()} x {out.element_size()}")
        if nbytes == 0:
            return out
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        done = 0
        while done < nbytes:
            got = os.preadv(self._fd, [view[done: done + _CHUNK]], self._base + start + done)
            if got <= 0:
                raise ValueError(f"{self.path}: ends inside tensor {name!r} (truncated file)")
            done += got
        return out

    def read_transient(self, name: str) -> torch.Tensor:
        """Tensor `name` in a buffer this file reuses for every such read: valid until the next one. For values
        that are copied elsewhere at once (into the host store): no per-tensor allocation whose freed pages
        the C heap would keep resident."""
        dtype, shape, start, end = self._entry(name)
        if self._scratch is None or self._scratch.numel() < end - start:
            self._scratch = None
            # a mapping of its own, returned to the OS when dropped (the C heap would keep freed pages resident)
            self._scratch = torch.frombuffer(mmap.mmap(-1, max(end - start, 1 << 20)), dtype=torch.uint8)
        return self.read_into(name, self._scratch[: end - start].view(dtype).view(shape))

    def sha256(self) -> tuple[int, str]:
        """(size, sha256) of the open file: what is checked is what is read."""
        digest, size = hashlib.sha256(), 0
        buf = memoryview(bytearray(_HASH_CHUNK))  # one buffer, refilled: the file never sits in memory
        while got := os.preadv(self._fd, [buf], size):
            digest.update(buf[:got])
            size += got
        return size, digest.hexdigest()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._last = self._scratch = None

    def __enter__(self) -> TensorFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        fd = getattr(self, "_fd", -1)
        if fd >= 0:
            os.close(fd)


class TensorFiles(Mapping[str, torch.Tensor]):
    """Several files' tensors as one mapping (a checkpoint's main file and its shards): each name is read
    from the file that holds it, so a reader that asks only for its own names opens no other's data."""

    def __init__(self, files: list[TensorFile]) -> None:
        self.files = files
        self._where: dict[str, TensorFile] = {}
        for f in files:
            for name in f:
                if name in self._where:
                    raise ValueError(f"tensor {name!r} is in both {self._where[name].path} and {f.path}")
                self._where[name] = f

    def _file(self, name: str) -> TensorFile:
        try:
            return self._where[name]
        except KeyError:
            raise KeyError(f"no tensor {name!r} in {', '.join(str(f.path) for f in self.files)}") from None

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._file(name)[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def dtype(self, name: str) -> torch.dtype:
        return self._file(name).dtype(name)

    def shape(self, name: str) -> torch.Size:
        return self._file(name).shape(name)

    def read_into(self, name: str, out: torch.Tensor) -> torch.Tensor:
        return self._file(name).read_into(name, out)

    def read_transient(self, name: str) -> torch.Tensor:
        return self._file(name).read_transient(name)

    def close(self) -> None:
        for f in self.files:
            f.close()
