"""Crash-consistent checkpoint files: a directory per tag, published atomically.

Layout under the checkpoint directory::

    latest                      text file naming the newest published tag (DeepSpeed's convention)
    <tag>/tensors.safetensors   all tensors, in the safetensors format
    <tag>/meta.json             JSON metadata (counters, hyper-parameters, config, client state)
    <tag>/optim-rank<r>.safetensors   data-parallel saves: the optimizer state rank r wrote itself (one host
                                store per node: its layers'), read through the same mapping as the main file
    <tag>/manifest.json         size and sha256 of each file above, plus a save sequence number

A save writes everything into a hidden temp directory inside the checkpoint directory, fsyncs each
file and the directory, renames it into place and fsyncs the parent; only then is `latest` replaced
(again via a temp file and a rename). A crash at any point therefore leaves either the previous state
or the new one, never a `latest` that names a half-written checkpoint. Loading re-hashes every file
against the manifest, so a flipped bit or a truncated file is reported by name instead of being
trained on.

The tensor file is written by streaming each tensor's bytes (hashing them on the way) rather than
through `safetensors.torch.save_file`, which first copies every tensor into one Python bytes object:
MegaTrain's whole point is a model that barely fits in host memory, so a save must not double it.
The file is standard safetensors. It is read back one tensor at a time (tensor_file.py): a load, like a
save, never holds a second copy of the model.

A sharded save (`begin`, each rank's `write_shard`, then rank 0's `publish`) writes every shard into the same
temp directory; the manifest lists each shard with the size and hash its writer reported, so the checkpoint
is whole only once every shard is, and a load refuses one whose shard is missing or damaged, naming it.

One writer per checkpoint directory is assumed; readers may run concurrently with it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from ..files.atomic import fsync_dir
from ..files.tensor_file import TensorFile, TensorFiles

__all__ = ["CheckpointError", "save", "begin", "write_shard", "publish", "load", "latest_tag", "list_checkpoints", "verify", "write_safetensors",
           "write_json"]

TENSORS_FILE = "tensors.safetensors"
META_FILE = "meta.json"
MANIFEST_FILE = "manifest.json"
LATEST_FILE = "latest"
SHARD_PREFIX = "optim-rank"  # optim-rank<r>.safetensors: the optimizer state a data-parallel rank wrote itself
FORMAT = "megatrain.run.checkpoint"
VERSION = 1

_TMP = ".tmp-"  # a save in progress (or one that crashed)
_OLD = ".old-"  # a checkpoint being replaced by a save under the same tag
_TRASH = ".trash-"  # a checkpoint being deleted by retention
_UUID_LEN = 32
_CHUNK = 64 << 20
_HASH_CHUNK = 1 << 20

# safetensors dtype codes for the dtypes a training checkpoint holds.
_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt; the message names the file."""




def _check_tag(tag: str) -> None:
    bad = (
        not isinstance(tag, str)
        or not tag
        or tag in (".", "..", LATEST_FILE)
        or tag.startswith(".")
        or any(c in tag for c in "/\\\0\n\r")
    )
    if bad:
        raise ValueError(
            f"checkpoint tag {tag!r} is not usable as a directory name (no path separators, no leading dot, not 'latest')"
        )


def _tensor_bytes(t: torch.Tensor):
    """A uint8 numpy view of a tensor's bytes (a copy only when it is not already a dense CPU tensor)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor],
                       metadata: dict[str, str] | None = None) -> tuple[int, str]:
    """Streams `tensors` to `path` as safetensors; returns (bytes written, sha256)."""
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name, t in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise ValueError(f"tensor name {name!r} is not allowed in a checkpoint")
        if not torch.is_tensor(t):
            raise TypeError(f"checkpoint entry {name!r} is a {type(t).__name__}, not a tensor")
        if t.dtype not in _ST_DTYPES:
            raise TypeError(f"checkpoint tensor {name!r} has dtype {t.dtype}, which is not supported")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # keeps the data section 8-byte aligned, as safetensors does
    digest = hashlib.sha256()
    size = 0
    with open(path, "wb") as f:
        for piece in (len(head).to_bytes(8, "little"), head):
            f.write(piece)
            digest.update(piece)
            size += len(piece)
        for t in tensors.values():
            data = memoryview(_tensor_bytes(t))
            for start in range(0, len(data), _CHUNK):
                chunk = data[start : start + _CHUNK]
                f.write(chunk)
                digest.update(chunk)
            size += len(data)
        f.flush()
        os.fsync(f.fileno())
    return size, digest.hexdigest()


def write_safetensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str] | None = None) -> Path:
    """Writes one safetensors file atomically (temp file, fsync, rename), streaming tensor by tensor."""
    path = Path(path)
    write_safetensors_hashed(path, tensors, metadata)
    return path


def write_safetensors_hashed(path: str | os.PathLike, tensors: dict[str, torch.Tensor],
                             metadata: dict[str, str] | None = None) -> tuple[int, str]:
    """`write_safetensors`, returning (bytes written, sha256) as hashed while writing."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        written = _write_safetensors(tmp, tensors, metadata)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return written


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    """Writes a JSON file atomically."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        _write_bytes(tmp, json.dumps(obj, indent=2).encode())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return path


def _write_bytes(path: Path, payload: bytes) -> tuple[int, str]:
    with open(path, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    return len(payload), hashlib.sha256(payload).hexdigest()


def _hash_file(path: Path) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    buf = memoryview(bytearray(_HASH_CHUNK))  # one buffer, refilled: a large file never sits in memory
    with open(path, "rb", buffering=0) as f:
        while got := f.readinto(buf):
            digest.update(buf[:got])
            size += got
    return size, digest.hexdigest()


def _read_manifest(ckpt: Path) -> dict[str, Any]:
    path = ckpt / MANIFEST_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: manifest missing (not a MegaTrain checkpoint, or an incomplete one)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: manifest unreadable ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{path}: not a {FORMAT} manifest")
    if manifest.get("version", 0) > VERSION:
        raise CheckpointError(f"{path}: written by a newer format version {manifest.get('version')} (this reads {VERSION})")
    return manifest


def _resolve(directory: Path, tag: str) -> Path:
    """The directory holding `tag`, including one caught mid-replacement by a crashed save."""
    path = directory / tag
    if path.is_dir():
        return path
    for old in sorted(directory.glob(f"{_OLD}*")):
        if old.name[len(_OLD) + _UUID_LEN + 1 :] == tag and (old / MANIFEST_FILE).is_file():
            return old
    return path


def list_checkpoints(directory: str | os.PathLike) -> list[tuple[int, str]]:
    """(save sequence number, tag) of every published checkpoint with a readable manifest, oldest first."""
    directory = Path(directory)
    found = []
    if not directory.is_dir():
        return found
    for child in directory.iterdir():
        if child.name.startswith(".") or not child.is_dir():
            continue
        try:
            manifest = _read_manifest(child)
        except CheckpointError:
            continue
        found.append((int(manifest.get("seq", 0)), child.name))
    return sorted(found)


def latest_tag(directory: str | os.PathLike) -> str | None:
    """The tag the `latest` pointer names, or None when nothing has been published."""
    try:
        tag = (Path(directory) / LATEST_FILE).read_text().strip()
    except FileNotFoundError:
        return None
    return tag or None


def _recover_and_clean(directory: Path) -> None:
    """Undo what a crashed save left behind: finish or roll back a replacement, drop temp and trash dirs."""
    for child in directory.iterdir():
        name = child.name
        if name.startswith(_OLD) and child.is_dir():
            tag = name[len(_OLD) + _UUID_LEN + 1 :]
            if tag and not (directory / tag).exists():
                os.rename(child, directory / tag)  # the new copy never landed: put the old one back
            else:
                shutil.rmtree(child, ignore_errors=True)
        elif name.startswith((_TMP, _TRASH)) and child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
        elif name.startswith(f".{LATEST_FILE}-") and child.is_file():
            child.unlink(missing_ok=True)


def _set_latest(directory: Path, tag: str) -> None:
    tmp = directory / f".{LATEST_FILE}-{uuid.uuid4().hex}"
    _write_bytes(tmp, tag.encode())
    os.replace(tmp, directory / LATEST_FILE)
    fsync_dir(directory)


def _prune(directory: Path, keep_last: int) -> list[str]:
    keep = {tag for _, tag in list_checkpoints(directory)[-keep_last:]}
    newest = latest_tag(directory)
    if newest:
        keep.add(newest)  # whatever else happens, the checkpoint `latest` names survives
    removed = []
    for _, tag in list_checkpoints(directory):
        if tag in keep:
            continue
        # Renamed away first, so a crash mid-delete never leaves a half-deleted dir that looks published.
        trash = directory / f"{_TRASH}{uuid.uuid4().hex}-{tag}"
        os.rename(directory / tag, trash)
        shutil.rmtree(trash, ignore_errors=True)
        removed.append(tag)
    if removed:
        fsync_dir(directory)
    return removed


def _check_keep(keep_last: int | None) -> None:
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last={keep_last!r} must be an int >= 1 (or None to keep everything)")


def begin(directory: str | os.PathLike, tag: str) -> Path:
    """Start a save of `tag`: a fresh hidden temp directory that shard files (`write_shard`, by any process
    that sees the directory) and then `publish` fill. Nothing there counts until `publish` renames it."""
    _check_tag(tag)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _recover_and_clean(directory)
    tmp = directory / f"{_TMP}{uuid.uuid4().hex}-{tag}"
    tmp.mkdir()
    return tmp


def write_shard(tmp: str | os.PathLike, name: str, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Write one shard file of a save in progress (`begin`'s directory) -> its manifest entry."""
    if not name.startswith(SHARD_PREFIX) or not name.endswith(".safetensors") or "/" in name or name == TENSORS_FILE:
        raise ValueError(f"shard file name {name!r} must look like {SHARD_PREFIX}<rank>.safetensors")
    size, sha = _write_safetensors(Path(tmp) / name, tensors)
    return {"bytes": size, "sha256": sha}


def publish(directory: str | os.PathLike, tag: str, tmp: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any],
            *, shards: dict[str, dict[str, Any]] | None = None, keep_last: int | None = None,
            update_latest: bool = True) -> Path:
    """Finish `begin`'s save: the main tensor file and meta, a manifest listing them and every shard (with the
    sizes and hashes their writers reported), then the atomic rename. The checkpoint is whole only then: a
    shard that is missing or differs from its entry makes the load refuse it, naming the file."""
    _check_keep(keep_last)
    try:
        try:
            meta_bytes = json.dumps(meta, indent=1).encode()
        except (TypeError, ValueError) as e:
            raise TypeError(f"checkpoint metadata is not JSON-serializable: {e}") from e
        directory = Path(directory)
        seq = max((s for s, _ in list_checkpoints(directory)), default=0) + 1
        files = {}
        for name, (size, sha) in (
            (TENSORS_FILE, _write_safetensors(tmp / TENSORS_FILE, tensors)),
            (META_FILE, _write_bytes(tmp / META_FILE, meta_bytes)),
        ):
            files[name] = {"bytes": size, "sha256": sha}
        for name, entry in sorted((shards or {}).items()):
            if not (tmp / name).is_file() or (tmp / name).stat().st_size != entry["bytes"]:
                raise CheckpointError(f"{tmp / name}: shard missing or not the size its writer reported")
            files[name] = {"bytes": int(entry["bytes"]), "sha256": entry["sha256"]}
        manifest = {"format": FORMAT, "version": VERSION, "tag": tag, "seq": seq, "created_unix": time.time(), "files": files}
        _write_bytes(tmp / MANIFEST_FILE, json.dumps(manifest, indent=1).encode())
        fsync_dir(tmp)

        final = directory / tag
        old = None
        if final.exists():
            old = directory / f"{_OLD}{uuid.uuid4().hex}-{tag}"
            os.rename(final, old)
        os.rename(tmp, final)
        fsync_dir(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    if update_latest:
        _set_latest(directory, tag)
    if keep_last is not None:
        _prune(directory, keep_last)
    return final


def save(
    directory: str | os.PathLike,
    tag: str,
    tensors: dict[str, torch.Tensor],
    meta: dict[str, Any],
    *,
    keep_last: int | None = None,
    update_latest: bool = True,
) -> Path:
    """Writes checkpoint `tag` under `directory` atomically and returns its path.

    `meta` must be JSON-serializable. An existing checkpoint with the same tag is replaced atomically.
    With `keep_last=N`, older checkpoints beyond the N newest are deleted afterwards, never the one
    `latest` names.
    """
    _check_tag(tag)
    _check_keep(keep_last)
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as e:
        raise TypeError(f"checkpoint metadata is not JSON-serializable: {e}") from e
    return publish(directory, tag, begin(directory, tag), tensors, meta, keep_last=keep_last,
                   update_latest=update_latest)


def verify(path: str | os.PathLike, *, opened: dict[str, TensorFile] | None = None) -> dict[str, Any]:
    """Checks every file of the checkpoint at `path` against its manifest; returns the manifest.

    `opened`: files already open for reading, hashed through their open descriptor (what is checked is then
    exactly what is read, even if the path is replaced meanwhile)."""
    path = Path(path)
    manifest = _read_manifest(path)
    for name, want in manifest["files"].items():
        file = path / name
        if opened and name in opened:
            size, sha = opened[name].sha256()
        else:
            if not file.is_file():
                raise CheckpointError(f"{file}: missing (listed in the manifest)")
            size, sha = file.stat().st_size, None
        if size != want["bytes"]:
            raise CheckpointError(f"{file}: truncated or resized: {size} bytes on disk, {want['bytes']} expected")
        if sha is None:
            _, sha = _hash_file(file)
        if sha != want["sha256"]:
            raise CheckpointError(f"{file}: corrupt: sha256 {sha} does not match the manifest's {want['sha256']}")
    return manifest


def load(
    directory: str | os.PathLike, tag: str | None = None, *, check: bool = True
) -> tuple[TensorFiles, dict[str, Any], Path]:
    """Reads checkpoint `tag` (default: the one `latest` names) -> (its tensors, meta, path).

    The tensors are a `TensorFile`: a mapping that reads each tensor from the file when it is asked for (or
    straight into a destination, `read_into`), so a load never holds the whole checkpoint in memory.
    With `check` (the default) every file is hashed and compared with the manifest first.
    """
    directory = Path(directory)
    if tag is None:
        tag = latest_tag(directory)
        if tag is None:
            raise FileNotFoundError(f"no checkpoint to load in {directory}: {directory / LATEST_FILE} does not exist")
    _check_tag(tag)
    path = _resolve(directory, tag)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint {tag!r} not found in {directory}")
    manifest = _read_manifest(path)  # not a checkpoint, or a half-written one: said before anything else is read
    names = [TENSORS_FILE] + sorted(n for n in manifest["files"] if n.startswith(SHARD_PREFIX))
    opened: dict[str, TensorFile] = {}
    try:
        for name in names:
            opened[name] = TensorFile(path / name)
        tensors = TensorFiles(list(opened.values()))
    except FileNotFoundError as e:
        for f in opened.values():
            f.close()
        raise CheckpointError(f"{e.filename}: missing (listed in the manifest)") from e
    except (OSError, ValueError) as e:
        for f in opened.values():
            f.close()
        if check:  # the manifest's sizes and hashes name the damage better than the decoder
            verify(path)
        raise CheckpointError(f"{path}: could not be decoded ({e})") from e
    if check:
        try:
            verify(path, opened=opened)
        except BaseException:
            tensors.close()
            raise
    try:
        meta = json.loads((path / META_FILE).read_text())
    except Exception as e:  # the bytes matched the manifest, so this is a writer bug, not disk damage
        tensors.close()
        raise CheckpointError(f"{path}: could not be decoded ({e})") from e
    return tensors, meta, path
