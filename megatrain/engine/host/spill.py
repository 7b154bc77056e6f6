"""The NVMe tier: spilled layers' update-only state in a file under `nvme_path`, in host memory only around
their update.

What spills, and for which layers, is costs/nvme.py's plan (Adam m and v, and the hi/lo master's "lo" half).
Each spilled layer has one record in one file: its pieces 256-byte aligned, the record a whole number of 4 KiB
blocks, so it moves with direct I/O (O_DIRECT) where the filesystem allows it and buffered positional I/O
where it does not (`direct` says which). Between updates a spilled layer's state tensors are views of a shared
mapping of that file: whoever reads or writes them (a checkpoint save, a load, a look by hand after
engine.synchronize()) reads or writes the file, and no host copy exists. Around layer i's update the state is
rebound to one of a small ring of page-aligned buffers: read there ahead of the update (layer i+1's read runs
while layer i updates), written back behind it (layer i's write runs while layer i+1 updates), on a pool of
I/O threads doing positional reads and writes. `nvme_gbps` slows those transfers to a given rate (as
`link_gbps` does the link) to show the overlap with an emulated slow disk.

The directory (megatrain-spill-<pid>-<random>) is removed when the engine goes away or the process exits,
exceptions included; one left by a killed process is removed by the next engine that uses the same nvme_path.
"""

from __future__ import annotations

import mmap
import os
import shutil
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from ...costs.modes import HostMaster
from ...costs.nvme import ALIGN, PIECE_ALIGN, SpillPlan, plan_spill, record_bytes, round_up
from .pinned import host_buffer
from .store import FlatGroup, HostStore

PREFIX = "megatrain-spill-"
CHUNK = 64 << 20  # bytes per system call: large enough to stream, small enough not to hold the GIL-free call long
KEYS = ("exp_avg", "exp_avg_sq")


class NvmeSpaceError(OSError):
    """nvme_path cannot hold the spilled state (full, missing, unwritable)."""


def sweep_stale(root: Path) -> list[Path]:
    """Remove spill directories under `root` whose process is gone (a SIGKILL leaves them); returns them."""
    gone = []
    for d in root.glob(PREFIX + "*"):
        try:
            pid = int(d.name[len(PREFIX):].split("-")[0])
        except ValueError:
            continue
        try:
            os.kill(pid, 0)
            continue  # alive (or not ours to signal): its own
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(d, ignore_errors=True)
        gone.append(d)
    return gone


def _remove(directory: str, fd: list[int]) -> None:
    for f in fd:
        try:
            os.close(f)
        except OSError:
            pass
    shutil.rmtree(directory, ignore_errors=True)


class SpillFile:
    """One preallocated file of `size` bytes under a fresh directory in `root`, read and written by position."""

    def __init__(self, root: str | os.PathLike, size: int, gbps: float | None = None) -> None:
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            sweep_stale(self.root)
            self.dir = self.root / f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
            self.dir.mkdir()
        except OSError as e:
            raise NvmeSpaceError(f"nvme_path={str(self.root)!r} cannot hold the spilled state ({size} bytes, "
                                 f"{size / 2**30:.3f} GiB): {e.strerror or e}; choose a writable directory") from e
        self.path = self.dir / "state.bin"
        self.size = size
        self._fds: list[int] = []
        self._final = weakref.finalize(self, _remove, str(self.dir), self._fds)
        try:
            self.fd, self.direct = self._open()
            os.posix_fallocate(self.fd, 0, size)  # a full disk fails here, before any training state changes
        except OSError as e:
            self._final()
            raise NvmeSpaceError(f"nvme_path={str(self.root)!r} cannot hold the spilled state: {size} bytes "
                                 f"({size / 2**30:.3f} GiB) could not be allocated in {self.path}: "
                                 f"{e.strerror or e}; free that much space or choose another nvme_path") from e
        self.map = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.base = torch.frombuffer(self.map, dtype=torch.uint8)  # the file as bytes (views of it between updates)
        self.gbps = gbps
        self._disk = threading.Lock()  # the emulated disk moves one transfer at a time
        self.bytes_read = self.bytes_written = 0
        self.io_s = 0.0

    def _open(self) -> tuple[int, bool]:
        flags = os.O_RDWR | os.O_CREAT
        if hasattr(os, "O_DIRECT"):
            fd = os.open(self.path, flags | os.O_DIRECT, 0o600)
            self._fds.append(fd)
            probe = host_buffer(ALIGN, torch.uint8)
            try:
                os.pwrite(fd, memoryview(probe.numpy()), 0)
                return fd, True
            except OSError:  # EINVAL: this filesystem takes no direct I/O (tmpfs, some overlays)
                os.close(self._fds.pop())
        fd = os.open(self.path, flags, 0o600)
        self._fds.append(fd)
        return fd, False

    def _move(self, write: bool, buf: torch.Tensor, offset: int) -> None:
        view = memoryview(buf.view(torch.uint8).numpy())
        t0 = time.perf_counter()
        with self._disk if self.gbps else _NOLOCK:
            done = 0
            while done < len(view):
                part = view[done: done + CHUNK]
                n = os.pwrite(self.fd, part, offset + done) if write else os.preadv(self.fd, [part], offset + done)
                if n <= 0:
                    raise OSError(f"{'write' if write else 'read'} of {len(part)} bytes at {offset + done} in "
                                  f"{self.path} returned {n}")
                done += n
            if self.gbps:  # the emulated disk: at least bytes / rate per transfer
                time.sleep(max(0.0, len(view) / (self.gbps * 1e9) - (time.perf_counter() - t0)))
        dt = time.perf_counter() - t0
        with _STATS:
            self.io_s += dt
            if write:
                self.bytes_written += len(view)
            else:
                self.bytes_read += len(view)

    def read(self, buf: torch.Tensor, offset: int) -> None:
        self._move(False, buf, offset)

    def write(self, buf: torch.Tensor, offset: int) -> None:
        self._move(True, buf, offset)

    def settle(self) -> None:
        """Write what was stored through the mapping to the file, and drop the mapping's pages from this process
        (they were read or written out of band: a checkpoint, a load)."""
        self.map.flush()
        self.map.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        self._final()


class _NoLock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NOLOCK = _NoLock()
_STATS = threading.Lock()


class _Record:
    """Where one spilled layer's pieces sit: in the file (offset) and, by the same layout, in a ring buffer."""

    def __init__(self, group: FlatGroup, params: list[torch.nn.Parameter], offset: int) -> None:
        self.group, self.params, self.offset = group, params, offset
        self.layout: list[tuple[Any, str, int, int, torch.dtype]] = []  # (param or None for lo, key, at, numel, dtype)
        at = 0
        for p in params:
            for k in KEYS:
                self.layout.append((p, k, at, p.numel(), torch.float32))
                at += round_up(p.numel() * 4, PIECE_ALIGN)
        if group.master_mode is HostMaster.HILO:
            self.layout.append((None, "lo", at, group.numel, torch.int16))
            at += round_up(group.numel * 2, PIECE_ALIGN)
        self.size = round_up(at, ALIGN)

    def views(self, base: torch.Tensor, start: int) -> dict[tuple[int, str], torch.Tensor]:
        out = {}
        for p, k, at, n, dtype in self.layout:
            t = base[start + at: start + at + n * (4 if dtype == torch.float32 else 2)].view(dtype)
            out[(id(p), k)] = t.view(p.shape) if p is not None else t
        return out


def spill_params(optimizer: torch.optim.Optimizer, group: FlatGroup) -> list[torch.nn.Parameter]:
    """Layer `group`'s parameters that `optimizer` steps (frozen ones have no state)."""
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    return [p for p in group.params if id(p) in held]


def record_sizes(optimizer: torch.optim.Optimizer, store: HostStore) -> list[int]:
    """Bytes of each layer's record (what spills when it does)."""
    hilo = store.master_mode is HostMaster.HILO
    out = []
    for g in store.layers:
        pieces = [p.numel() * 4 for p in spill_params(optimizer, g) for _ in KEYS]
        out.append(record_bytes(pieces + ([g.numel * 2] if hilo else [])))
    return out


class Spill:
    """The spilled layers of one engine: their file, ring buffers, I/O threads and the optimizer's hooks."""

    def __init__(self, optimizer: torch.optim.Optimizer, store: HostStore, plan: SpillPlan, root: str,
                 gbps: float | None, sync: Callable[[], None], threads: int = 2) -> None:
        self.optimizer, self.store, self.plan = optimizer, store, plan
        self._sync = sync  # waits for the optimizer thread (queued updates) to finish
        self.records: dict[int, _Record] = {}
        offset = 0
        for i in plan.spilled:
            rec = _Record(store.layers[i], spill_params(optimizer, store.layers[i]), offset)
            self.records[i] = rec
            offset += rec.size
        self.order = list(plan.spilled)
        self.file = SpillFile(root, offset, gbps)
        self.ring = [host_buffer(plan.record, torch.uint8) for _ in range(plan.slots)]
        self._slot_of = {i: k % plan.slots for k, i in enumerate(self.order)}
        self._next = dict(zip(self.order, self.order[1:])) if plan.slots > 1 else {}  # read ahead behind each layer
        self._filed = {i: r.views(self.file.base, r.offset) for i, r in self.records.items()}
        self._slotted = {i: r.views(self.ring[self._slot_of[i]], 0) for i, r in self.records.items()}
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="nvme-io")
        self._reads: dict[int, Future] = {}  # layer -> its read into its ring buffer, in flight or done
        self._writes: list[Future | None] = [None] * plan.slots  # the last write out of each ring buffer
        self.wait_s = 0.0  # the optimizer thread's time blocked on a read: I/O that did not hide
        self._park_all()
        optimizer.register_state_dict_pre_hook(lambda opt: self.flush())
        optimizer.register_load_state_dict_pre_hook(lambda opt, sd: self.flush())
        optimizer.register_load_state_dict_post_hook(lambda opt: self._park_all())

    # -- between updates: the state is the file ------------------------------------------------------------
    def _park_all(self) -> None:
        """Make every spilled layer's state (and lo) views of the file, copying in whatever is elsewhere."""
        for i, rec in self.records.items():
            filed = self._filed[i]
            for p in rec.params:
                st = self.optimizer.state.get(p)
                for k in KEYS if st else ():
                    if k in st and st[k].data_ptr() != filed[(id(p), k)].data_ptr():
                        filed[(id(p), k)].copy_(st[k])
                        st[k] = filed[(id(p), k)]
            if (id(None), "lo") in filed and rec.group.lo.data_ptr() != filed[(id(None), "lo")].data_ptr():
                filed[(id(None), "lo")].copy_(rec.group.lo)
                rec.group.lo = filed[(id(None), "lo")]
        self.file.settle()

    def flush(self) -> None:
        """Every queued update and every write behind it done: the file holds the state."""
        self._sync()
        for f in [*self._writes, *self._reads.values()]:
            if f is not None:
                f.result()
        self._reads.clear()
        self.file.settle()

    # -- around an update -------------------------------------------------------------------------------
    def _read(self, i: int) -> Future:
        k = self._slot_of[i]
        before = self._writes[k]
        rec = self.records[i]

        def job() -> None:
            if before is not None:
                before.result()  # the ring buffer's last occupant is on disk first
            self.file.read(self.ring[k][: rec.size], rec.offset)

        return self.pool.submit(job)

    def begin_step(self) -> None:
        """A step's updates are about to be queued: read the first spilled layer ahead."""
        if self.order:
            self.file.settle()  # out-of-band writes through the mapping reach the file before the direct reads
            self._reads[self.order[0]] = self._read(self.order[0])

    def before(self, i: int) -> None:
        """Bind layer i's state to its ring buffer (read, or adopted from wherever torch put it)."""
        fut = self._reads.pop(i, None) or self._read(i)
        t0 = time.perf_counter()
        fut.result()
        self.wait_s += time.perf_counter() - t0
        nxt = self._next.get(i)
        if nxt is not None:
            self._reads[nxt] = self._read(nxt)
        self._rebind(i, self._filed[i], self._slotted[i])

    def _rebind(self, i: int, current: dict[tuple[int, str], torch.Tensor],
                target: dict[tuple[int, str], torch.Tensor]) -> None:
        """Layer i's state tensors (and hilo's lo) re-pointed from the `current` views to the `target` ones. A
        state tensor that is not `current`'s (torch made it at the first step, or a load replaced it) is copied
        into the ring buffer first: the ring buffer is what the update reads and the write-behind writes."""
        slotted, rec = self._slotted[i], self.records[i]
        for p in rec.params:
            st = self.optimizer.state.get(p)
            for k in KEYS if st else ():
                if k in st:
                    if st[k].data_ptr() != current[(id(p), k)].data_ptr():
                        slotted[(id(p), k)].copy_(st[k])
                    st[k] = target[(id(p), k)]
        if (id(None), "lo") in target:
            rec.group.lo = target[(id(None), "lo")]

    def after(self, i: int) -> None:
        """Layer i's state back to the file views; its ring buffer written behind, on an I/O thread."""
        self._rebind(i, self._slotted[i], self._filed[i])
        k, rec = self._slot_of[i], self.records[i]
        self._writes[k] = self.pool.submit(self.file.write, self.ring[k][: rec.size], rec.offset)

    def around(self, i: int, update: Callable[[], None]) -> None:
        """Run layer i's update with its state in host memory (a layer that does not spill: as it is)."""
        if i not in self.records:
            update()
            return
        self.before(i)
        try:
            update()
        finally:
            self.after(i)

    def stats(self) -> dict[str, Any]:
        f = self.file
        return {"nvme_spilled_layers": len(self.order), "nvme_direct_io": f.direct, "nvme_bytes_read": f.bytes_read,
                "nvme_bytes_written": f.bytes_written, "nvme_io_s": f.io_s, "nvme_wait_s": self.wait_s,
                "nvme_disk_bytes": f.size, "nvme_host_bytes": self.plan.resident_bytes}

    def close(self) -> None:
        """Finish the I/O and remove the files (the state goes with them: for an engine no longer used)."""
        self.pool.shutdown(wait=True)
        self.file.close()


def store_fixed_bytes(store: HostStore, optimizer: torch.optim.Optimizer) -> int:
    """Host bytes that never spill: the store less the hi/lo masters' lo halves, plus the globals' Adam state."""
    lo = sum(g.lo.numel() * g.lo.element_size() for g in store.layers if g.lo is not None)
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    glob = sum(p.numel() * 8 for p in store.globals.params if id(p) in held)
    return store.host_bytes() - lo + glob


SpillFactory = Callable[[torch.optim.Optimizer, Callable[[], None]], "Spill | None"]


def spill_for(store: HostStore, config: Any, node: Any) -> SpillFactory | None:
    """The engine's NVMe tier for `config`, to be built by the update path that runs its layer updates (None when
    nvme_path is unset): called with the optimizer and the wait for its queued updates, it gives the Spill whose
    `around` those updates run through, or None when everything fits the budget. Refuses what it cannot keep
    exact, by name: the settings now, the optimizer when it is given."""
    if config.nvme_path is None:
        return None
    if node is not None:
        raise ValueError("nvme_path keeps each rank's own optimizer state on disk; with several data-parallel ranks "
                         "set data_parallel_host='replicated' (the shared host store does not spill)")
    if config.optimizer_in_backward:
        raise ValueError("nvme_path spills the state of layer updates that run after backward; it does not combine "
                         "with optimizer_in_backward (set optimizer_in_backward=false)")

    def build(opt: torch.optim.Optimizer, sync: Callable[[], None]) -> Spill | None:
        if any(g.get("amsgrad") for g in opt.param_groups):
            raise ValueError("nvme_path spills Adam's m and v; amsgrad's third state tensor is not spilled: use "
                             "amsgrad=False with nvme_path")
        # A budget below one layer's working set raises BudgetTooSmall here, naming the minimum, before any step.
        plan = plan_spill(store_fixed_bytes(store, opt), record_sizes(opt, store), config.host_budget_bytes)
        if not plan.active:
            return None
        return Spill(opt, store, plan, config.nvme_path, config.nvme_gbps, sync)

    return build
