"""Data parallel across processes on torch.distributed: one engine per rank, gradients averaged per layer.

Started the way torchrun, `accelerate launch` and the deepspeed launcher start a job: RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT in the environment (or a process group the caller already made).
Every rank streams layers through its own device and adds its gradients into its own host slabs, as one
process does. At a synchronising backward (the last micro-batch before an optimizer step) each layer's
slab is averaged across ranks by a job on an "allreduce" host thread as soon as that layer's gradients
have landed, while the compute thread already runs the next layer's backward; the layer's `landed` event
becomes the average's, so every reader of the slab (norm, clipping, the overlapped optimizer) waits for it.
The resident parameters' slab (head, norm, embedding) is averaged last, once their gradients are in.

Why the host slab and not the device gradient: with accumulation the slab holds the sum of earlier
micro-batches that the device no longer has; averaging the slab once per optimizer step reduces exactly
what the optimizer reads, and a common part plus per-rank parts averages to the common part plus their
mean, so a slab reduced twice (two synchronising backwards) is still right. Host tensors need a
collective backend that reads host memory: the engine's own group is gloo whatever the device (a NCCL
default group stays the user's).

Averaging per-rank gradients is DDP's and DeepSpeed's rule: with a mean loss it equals one process with
the concatenated batch when every rank's micro-batch has the same number of label tokens.

Faults: the group's timeout is (just under) the engine's watchdog time, so a collective with a dead peer fails at
once (connection reset) and one with a hung peer fails after the watchdog time; either way the job's
error names this rank, the layer and the likely cause, and is raised on the training thread by the
next wait, never a silent hang.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar

import torch
import torch.distributed as dist

from ..host.node_store import NodeStore
from ..host.store import FlatGroup, HostStore
from ..runtime.stream import CopyStream, Event, Trace

T = TypeVar("T")


class DataParallelError(RuntimeError):
    """A collective across the data-parallel ranks failed (a peer died, hung or runs a different model)."""


class LaunchEnv(NamedTuple):
    rank: int
    world_size: int
    local_rank: int


def _env_int(name: str, default: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ValueError(f"WORLD_SIZE > 1 but {name} is not set: launch with torchrun, accelerate launch or the "
                             "deepspeed launcher (they set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def launch_env() -> LaunchEnv:
    """This process's place in the job, from the launcher's environment (a lone process: rank 0 of 1)."""
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        return LaunchEnv(rank, world, _env_int("LOCAL_RANK", rank if world > 1 else 0))
    world = _env_int("WORLD_SIZE", 1)
    if world < 1:
        raise ValueError(f"WORLD_SIZE={world} must be >= 1")
    if world == 1:
        return LaunchEnv(0, 1, 0)
    rank = _env_int("RANK")
    local = _env_int("LOCAL_RANK", rank)
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world}")
    return LaunchEnv(rank, world, local)


@functools.cache
def destroy_at_exit() -> None:
    """Tear the default process group down at interpreter exit (an atexit hook, registered once), before Python
    finalizes. Left to finalization, a gloo worker thread still releasing its last work (the Trainer's final
    all_gather) took the GIL of a finalizing interpreter, which ends the thread by a forced unwind through C++
    frames: std::terminate ("terminate called without an active exception"), seen in 1-2 exits in 20 of a Trainer
    script on the DeepSpeed face (its core: ProcessGroupGloo::runLoop in ~AsyncAllgatherWork, decref'ing a tensor).
    Registered by every engine built in a process with a group (join_ranks), whoever made the group."""
    atexit.register(_destroy)


def _destroy() -> None:
    # Gloo groups only: an NCCL group's teardown can block on a collective a dead peer never joins (a rank
    # exiting on a watchdog error), and its exit is torch's own (the crash above is gloo's worker threads).
    if dist.is_available() and dist.is_initialized() and "nccl" not in str(dist.get_backend()):
        try:
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001 - exiting anyway: say so, do not mask the exit status
            print(f"megatrain: could not destroy the process group at exit: {e}", file=sys.stderr)
    # A gloo worker releases a finished work (and its tensors, under the GIL) just after the waiter returned; the
    # group may outlive destroy_process_group (other references): let such a release take the GIL now, while
    # the interpreter is alive (it is a wait for the GIL of microseconds; 50 ms leaves margin on a loaded host).
    time.sleep(0.05)


def init_process_group(device: torch.device, timeout_s: float) -> None:
    """The default process group from the launcher's variables, unless the caller made one already."""
    if dist.is_initialized():
        return
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):
            raise ValueError(f"WORLD_SIZE > 1 but {name} is not set: launch with torchrun, accelerate launch or the "
                             "deepspeed launcher, or call torch.distributed.init_process_group first")
    env = launch_env()
    if device.type == "cuda" and device.index is None:
        torch.cuda.set_device(env.local_rank)  # before NCCL binds this process to a device
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, init_method="env://", rank=env.rank, world_size=env.world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def join_ranks(device: torch.device, watchdog_s: float, trace: bool = False
               ) -> tuple[torch.device, DataParallel | None, Trace]:
    """Launched as one of several ranks (torchrun & co.): join the job (before the model is touched) and, on a GPU
    with no index named, take this node's device LOCAL_RANK. A lone process: `device` and None. With the engine's
    timeline (`trace`: on or off), made once the device is known, so the ranks' own streams record into it too."""
    env = launch_env()
    if env.world_size > 1 and device.type == "cuda" and device.index is None:
        device = torch.device("cuda", env.local_rank)
    timeline = Trace(trace, device)
    dp = DataParallel.from_env(device, watchdog_s, timeline)
    if dist.is_available() and dist.is_initialized():
        destroy_at_exit()  # whoever made the group (accelerate, the user): an engine trains in this process
    if dp is not None and device.type == "cuda":
        torch.cuda.set_device(device)  # the streams' waits act on the current device's stream
    return device, dp, timeline


def broadcast_group(g: FlatGroup, src: int, group: dist.ProcessGroup) -> None:
    """Every rank of `group` takes rank `src`'s master values of `g`, whatever its host mode (a private hilo
    tie list, not of a fixed size, goes as an object)."""
    for t in g.master_tensors():
        # As bytes where gloo has no such type (bf16, int16): a broadcast moves bits, whatever they mean.
        dist.broadcast(t if t.dtype in (torch.float32, torch.int64) else t.view(torch.uint8), src=src, group=group)
    if g.lo is not None and g.tie_table is None:
        ties = [g.ties]
        dist.broadcast_object_list(ties, src=src, group=group)
        g.ties = ties[0]


class DataParallel:
    """This rank's share of a data-parallel job: the engine's gradient group and its reduction thread."""

    def __init__(self, env: LaunchEnv, watchdog_s: float, trace: Trace | None = None) -> None:
        self.rank = env.rank
        self.world_size = env.world_size
        self.local_rank = env.local_rank
        self.watchdog_s = watchdog_s
        # The engine's own group: its collectives run on a host thread, and sharing a group with the
        # user's own collectives (issued from the training thread) could interleave them differently on
        # different ranks. Creating it is itself collective: every rank builds its engine in step.
        # Its timeout a little under the watchdog's, so a dead or hung peer surfaces as this module's error
        # (naming the cause) rather than as a bare "no progress" from the thread waiting on the average.
        self.timeout = timeout = datetime.timedelta(seconds=max(0.9 * watchdog_s, 0.1))
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        self.node: NodeStore | None = None  # the shared host store's node, once share_host_store() made it
        # `trace`: the engine's timeline (join_ranks), or none.
        self.stream = CopyStream("allreduce", torch.device("cpu"), trace or Trace(False), None, watchdog_s)
        # Shared store with optimizer_overlap: the per-layer "updated" tokens, on a thread (and group) of their own.
        self.updates = CopyStream("layer-updates", torch.device("cpu"), trace or Trace(False), None, watchdog_s)
        # After one failed collective the group is unusable: later averages fail at once with the first
        # error instead of each waiting out its own timeout.
        self.broken: DataParallelError | None = None

    @classmethod
    def from_env(cls, device: torch.device, watchdog_s: float, trace: Trace | None = None) -> DataParallel | None:
        """None for a lone process; otherwise joins (or makes) the default group and builds the engine's."""
        env = launch_env()
        if env.world_size == 1:
            return None
        init_process_group(device, watchdog_s)
        return cls(launch_env(), watchdog_s, trace)

    def fail(self, what: str, exc: BaseException) -> DataParallelError:
        """The error every collective of this job raises when it fails (the node path's too: node_path.py): names this
        rank and what it was doing."""
        return DataParallelError(
            f"data parallel rank {self.rank} of {self.world_size}: {what} failed ({exc}). A peer rank died, hung "
            f"for longer than the watchdog ({self.watchdog_s:.1f}s) or runs a different model or schedule; see its log")

    def guarded(self, what: str, work: Callable[[], T]) -> T:
        """Run one collective outside the reducer (the node path's, the nodes' shared store's). A peer that died or
        hung fails it (at the groups' timeout, just under the watchdog's) with the job's error naming this rank, and
        marks the job broken: the other streams' collectives then fail at once with it instead of each waiting out
        its own timeout."""
        if self.broken is not None:
            raise self.broken
        try:
            return work()
        except Exception as exc:
            if isinstance(exc, DataParallelError):
                raise
            self.broken = self.fail(what, exc)
            raise self.broken from exc

    # -- start-up -----------------------------------------------------------------------------------
    def check_same_model(self, store: HostStore) -> None:
        """Refuse ranks whose stores differ in layout: their collectives would mismatch, not fail."""
        mine = [len(store.layers)] + [g.numel for g in store.groups()]
        shapes: list[list[int] | None] = [None] * self.world_size
        try:
            dist.all_gather_object(shapes, mine, group=self.group)
        except Exception as exc:
            raise self.fail("comparing the model layout across ranks", exc) from exc
        for r, other in enumerate(shapes):
            if other != mine:
                raise DataParallelError(f"data parallel rank {self.rank}: rank {r} holds a model of another layout "
                                        f"(layers, group sizes {other} vs {mine}); every rank must build the same model")

    def share_host_store(self, make: Callable[[], NodeStore] | None = None) -> NodeStore:
        """Join this node's shared host store (engine/host/node_store.py): collective over every rank. `make`: the
        store where it is not the plain NodeStore (nodes sharing one store, several ranks per node: shared_store.py)."""
        try:
            self.node = make() if make is not None else NodeStore(self.rank, self.group, self.timeout, self.watchdog_s)
        except (RuntimeError, ValueError) as exc:
            raise self.fail("setting up the node's shared host store", exc) from exc
        return self.node

    def broadcast_masters(self, store: HostStore) -> None:
        """Every rank starts from rank 0's weights (as DDP does): differing random inits would drift silently.

        With a shared store the node's first rank wrote the layers (engine.py packs them there only) and the
        first ranks of the other nodes take rank 0's; the resident parameters go to every rank."""
        node = self.node
        try:
            if getattr(node, "shares_across_nodes", False) or getattr(node, "spans_nodes", False):
                groups = [store.globals]  # each layer is its owner's alone: nothing of it to keep alike
            elif node is None:
                groups = store.groups()
            else:
                groups = [store.globals]
                if node.leader and node.cross_group is not None:  # the cross group of local index 0: the leaders
                    for g in store.layers:
                        broadcast_group(g, 0, node.cross_group)
            for g in groups:
                broadcast_group(g, 0, self.group)
            if node is not None:
                node.barrier()  # no rank reads a layer before its node's copy is whole
        except Exception as exc:
            raise self.fail("broadcasting rank 0's initial weights", exc) from exc

    def broadcast_from(self, store: HostStore, src: int) -> None:
        """Every rank takes rank `src`'s masters (weights written by hand on one rank). With a shared store the
        ranks of a node receive into the same memory the same bytes, so that is still one consistent copy."""
        self.synchronize()
        try:
            for g in store.groups():
                broadcast_group(g, src, self.group)
            if self.node is not None:
                self.node.barrier()
        except Exception as exc:
            raise self.fail(f"broadcasting rank {src}'s written weights", exc) from exc

    def submit_reduce_to_owner(self, layer: int, grads: torch.Tensor, slab: torch.Tensor | None,
                               after: Sequence[Event], fresh: bool = False) -> Event:
        """Queue layer `layer`'s reduction into its owner's slab (shared host store) once `after` are done;
        `fresh`: the slab is zeroed first (it holds the average alone: the optimizer in backward's)."""
        node = self.node

        def reduce() -> int:
            if fresh and slab is not None:
                slab.zero_()
            return node.reduce_to_owner(layer, grads, slab)

        return self._submit(reduce, after,
                            f"reducing the gradients of layer {layer} to its owner",
                            "gradient reduce to the layer's owner", layer)

    def submit_add_transit(self, layer: int, transit: torch.Tensor, slab: torch.Tensor | None,
                           after: Sequence[Event]) -> Event:
        """Queue the node path's landing of layer `layer`'s gradient (every rank's shard in `transit`) into its
        owner's slab (NodeStore.add_transit) once `after` are done."""
        node = self.node
        return self._submit(lambda: node.add_transit(layer, transit, slab), after,
                            f"adding the node's reduce-scattered gradients of layer {layer} to its owner's slab",
                            "gradient shards to the layer's owner", layer)

    def submit_publish(self, layer: int, updated: Event) -> Event:
        """Queue layer `layer`'s "updated" token from its owner to the node's ranks (after `updated`, the owner's
        update job; a no-op elsewhere); the returned event is when this rank may load the layer again."""
        node = self.node

        def job() -> int:
            try:
                node.publish(layer)
            except Exception as exc:
                raise self.fail(f"waiting for layer {layer}'s update by rank {node.owner_rank(layer)}", exc) from exc
            return 0

        return self.updates.submit(job, (updated,), "layer update token", layer)

    def synchronize_updates(self) -> None:
        try:
            self.updates.synchronize()
        except RuntimeError as exc:
            raise self.fail("waiting for the other ranks' layer updates", exc) from exc

    def sum_across_node(self, value: float) -> float:
        """The sum of `value` over the node's ranks (each holds its owned layers' part of a norm)."""
        t = torch.tensor([value], dtype=torch.float64)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.node.node_group)
        except Exception as exc:
            raise self.fail("summing the gradient norm across the node", exc) from exc
        return float(t.item())

    def max_across(self, value: int, what: str) -> int:
        """The largest of every rank's `value` (on the training thread, once the gradient thread is idle)."""
        self.synchronize()
        t = torch.tensor([value], dtype=torch.int64)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        except Exception as exc:
            raise self.fail(what, exc) from exc
        return int(t.item())

    def node_barrier(self, what: str) -> None:
        try:
            self.node.barrier()
        except Exception as exc:
            raise self.fail(what, exc) from exc

    # -- gradients ----------------------------------------------------------------------------------
    def average_(self, grad: torch.Tensor) -> None:
        """grad <- the mean of every rank's grad, in place."""
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=self.group)
        grad.div_(self.world_size)

    def submit_average(self, group: FlatGroup, after: Event | Sequence[Event], what: str, layer: int) -> Event:
        """Queue the average of `group`'s gradient slab once `after` is done; its event is the slab's new `landed`.

        Jobs run in submission order on one thread, the same order on every rank (backward's layer order,
        then the resident parameters), which is what keeps the collectives matched.
        """
        grad = group.grad

        def average() -> int:
            self.average_(grad)
            return grad.numel() * grad.element_size()

        return self._submit(average, after, f"averaging the gradients of {what}", "gradient average across ranks",
                            layer)

    def _submit(self, work: Callable[[], int], after: Event | Sequence[Event], what: str, label: str,
                layer: int) -> Event:
        """Queue a collective on the gradient thread. After one fails the group is unusable: later jobs fail at
        once with the first error instead of each waiting out its own timeout."""

        return self.stream.submit(lambda: self.guarded(what, work), after, label, layer)

    def synchronize(self) -> None:
        try:
            self.stream.synchronize()
        except RuntimeError as exc:
            raise self.fail("waiting for the gradient averages", exc) from exc
