"""One atomic write: a file appears whole under its name or not at all, whatever stops the writer.

The data goes to a temporary name beside the target (same directory, so the rename never crosses a file system),
is flushed (and with `durable=True` fsynced, the directory too, so a power cut keeps it), then renamed over the
target; a failure removes the temporary file and leaves any earlier target as it was.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["atomic_path", "atomic_write", "fsync_dir"]


def fsync_dir(path: str | os.PathLike) -> None:
    """Makes a rename inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: str | os.PathLike, *, durable: bool = False, mkdir: bool = False) -> Iterator[Path]:
    """Yields a temporary path to write `path`'s content to; on leaving without an error it becomes `path`."""
    path = Path(path)
    if mkdir:
        path.parent.mkdir(parents=True, exist_ok=True)
    # hidden, and unique per writer: concurrent writers (points, ranks) never share a temporary file
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        yield tmp
        if durable:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    if durable:
        fsync_dir(path.parent)


def atomic_write(path: str | os.PathLike, data: str | bytes, *, durable: bool = False, mkdir: bool = True) -> Path:
    """Writes `data` (text as UTF-8) to `path` atomically; returns the path."""
    with atomic_path(path, durable=durable, mkdir=mkdir) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    return Path(path)
