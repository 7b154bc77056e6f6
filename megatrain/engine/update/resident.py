"""Optimizer residency: the first layers' FP32 master, gradient slab and Adam state on the device.

A streamed layer's step costs host traffic (its gradient copied down and reduced into the host slab, the host's
AdamW over master, m and v, the new weights copied back up) while the device waits. Where the device has room, an
optimizer-resident layer (`residency={"optimizer": k, ...}`, costs/residency.py) keeps it all there:

- its group's buffers (engine/host/store.py FlatGroup) are moved onto the device once, when the engine is built:
  an FP32 master (an exact hi/lo master is joined into FP32 first, which is its value: the same bits train on),
  its compute-dtype shadow (the kept weights the layer computes with: no copy up) and its gradient slab in the
  store's dtype; the optimizer, built over the groups' Parameters after this, makes Adam's m and v beside them;
- its gradients are added into the device slab on the compute thread as the layer's backward yields them, the
  same adds as the host reduction (schedule.py), with the norm the clip reads measured the same way: no copy
  down, no reducer job;
- its update runs in step() on the caller's thread (update.py Layered, and WholeStep's optimizer.step() over
  every parameter), with the same param groups, hyper-parameters, pending clip and non-finite verdict as the host
  layers; on a CPU device it is the host path's own update (the same function, the same bits), elsewhere
  torch's AdamW over the whole group (`fused=True` where the device has the kernel, as the host masters do);
- the speculative step leaves it out (it updates at step time, on the device).

Refused, with the reason: the optimizer in backward (no slab), the NVMe tier, data-parallel ranks, a bf16 master
(not exact: its device FP32 master would train differently), a layer of a node's shared store.
"""

from __future__ import annotations

import logging

import torch

from ...config.schema import EngineConfig
from ...costs.modes import HostMaster
from ..host.codec import LOADED_BF16, master_codec
from ..host.store import FlatGroup, HostStore

log = logging.getLogger("megatrain")


def refusal(config: EngineConfig, store: HostStore, data_parallel: bool) -> str | None:
    """Why layers cannot update on the device with this configuration, or None if they can."""
    if config.optimizer_in_backward:
        return "optimizer_in_backward consumes each layer's gradients in backward on the host (no slab to keep)"
    if config.nvme_path is not None:
        return "nvme_path spills host optimizer state to disk"
    if data_parallel:
        return "several data-parallel ranks average the gradient slabs on the host"
    if store.master_mode is HostMaster.BF16:
        return ("host_master='bf16' is not exact: an FP32 master on the device would train differently; use "
                "host_master 'fp32' or 'hilo'")
    if any(not g.owned for g in store.layers):
        return "a node's shared host store holds the layers' masters"
    return None


def requested(config: EngineConfig, n_layers: int) -> int | None:
    """The optimizer-resident count the setting fixes (None: "auto" decides)."""
    r = config.residency_set
    return None if r is None else min(r.optimizer, n_layers)


def auto_applies(config: EngineConfig, device: torch.device, store: HostStore) -> bool:
    """Whether "auto" sizes optimizer residency: within a device budget (a GPU's, or one emulated), or on a CPU
    device computing on the host itself, where its "device" memory is the host's and an FP32 master is already
    where it would go (every layer, nothing copied). A CPU device emulating a link with no budget stands for a
    GPU of unknown size, a hi/lo master there would take FP32 bytes its host mode was chosen to save, and a run that
    asks for the host's update overlapped or speculated (optimizer_overlap, speculative_step True) asks for the
    host path on the same cores: none."""
    if device.type != "cpu" or config.device_budget_bytes is not None:
        return True
    return (config.link_gbps is None and store.master_mode is HostMaster.FP32 and not config.optimizer_overlap
            and config.speculative_step is not True)


def reserve_tokens(hf_config: object) -> int:
    """The batch whose working set "auto" leaves free beside the optimizer state (which no later batch can take
    back): the model's context window."""
    return int(getattr(hf_config, "max_position_embeddings", 0) or 0)


def resolve(config: EngineConfig, store: HostStore, data_parallel: bool, auto_count: int) -> int:
    """The count of optimizer-resident layers: as set (refused with the reason where it cannot run), or "auto"'s
    `auto_count` where it can run (else 0)."""
    n = len(store.layers)
    asked = requested(config, n)
    reason = refusal(config, store, data_parallel)
    if asked is None:
        if reason is not None:
            log.info("optimizer residency: none (%s)", reason)
            return 0
        return min(auto_count, n)
    if asked and reason is not None:
        raise ValueError(f"residency optimizer={asked}: {reason}; set residency 'optimizer' to 0 (or residency "
                         f"'auto')")
    return asked


def move(group: FlatGroup, device: torch.device, relocate: bool = False) -> None:
    """Make `group` an FP32-master group on `device`: master, shadow and gradient slab there, its Parameters
    views of the device master. An FP32 group on a CPU device is there already (nothing copied) unless `relocate`
    asks for fresh buffers anyway (what a move to a GPU does to every reference to the old ones)."""
    if group.masters is LOADED_BF16:
        # A frozen layer held as loaded (codec.LoadedBf16): nothing updates it, so only its bf16 weights go (the
        # device keeps them as its compute copy where it computes in bf16); an FP32 master made of them would hold
        # 4 more bytes a parameter of weights that never change. On a CPU device they are where they go.
        if device.type != "cpu" or relocate:
            held = group.shadow.to(device, copy=True)
            group.shadow = group.work = held
            with torch.no_grad():
                for p, s in zip(group.params, group.slots):
                    p.data = group.view(held, s)
        return
    fp32 = group.master_mode is HostMaster.FP32
    if fp32 and device.type == "cpu" and not relocate:
        return
    if fp32:
        value = group.master
    else:  # hilo: its exact FP32 value, joined into the store's scratch (which its Parameters viewed)
        group.unpack()
        value = group.work
    master = value.to(device, torch.float32, copy=True)
    # The resident group's frozen tail held as loaded in bf16 (codec.FrozenTail): its weights go as they are.
    tail = group.held_tail.to(device, copy=True) if group.held_tail is not None else None
    # The shadow is RNE(master) in both exact modes (an FP32 master's refresh; hilo's hi half): the weights the
    # layer computes with, already rounded.
    shadow = group.shadow.to(device, copy=True) if group.shadow is not None else None
    if group.grad is None:  # a frozen layer (engine/model/trainable.py): no slab here either
        grad = grad_work = None
    else:
        n = group.grad.numel()  # the resident parameters' ends before the frozen ones (engine/model/trainable.py)
        grad = torch.zeros(n, dtype=group.grad.dtype, device=device)
        grad_work = grad if group.grad_work is group.grad else torch.zeros(n, dtype=torch.float32, device=device)
    if tail is None:
        group.masters = master_codec(HostMaster.FP32)
    group.master, group.shadow, group.lo, group.tie_table, group.work = master, shadow, None, None, master
    group.held_tail = tail
    group.ties = torch.empty(0, dtype=torch.int64)
    group.grad, group.grad_work = grad, grad_work
    m = master.numel()
    with torch.no_grad():
        for p, s in zip(group.params, group.slots):
            p.data = group.view(master, s) if s.offset < m else tail[s.offset - m: s.offset - m + s.numel].view(s.shape)
    group.link_grads()


def place(store: HostStore, count: int, device: torch.device) -> frozenset[int]:
    """Move the first `count` layers' optimizer state onto `device` (before the optimizer is built over them);
    the layers that now update there."""
    for group in store.layers[:count]:
        move(group, device)
    if count:
        log.info("optimizer residency: %d of %d layers' FP32 master, gradients and Adam state on %s (updated there)",
                 count, len(store.layers), device)
    return frozenset(range(count))


def place_globals(store: HostStore, count: int, device: torch.device) -> bool:
    """The resident parameters' (embedding, final norm, LM head) FP32 master, gradient slab and Adam state onto
    `device` whenever any layer's optimizer is there (`count` > 0): the next forward reads them first, and their
    update is otherwise the host's AdamW on the launch thread plus a gradient copy down and an upload each step.
    Whether they update there."""
    if not count:
        return False
    move(store.globals, device)
    log.info("optimizer residency: the resident parameters' FP32 master, gradients and Adam state on %s", device)
    return True


def on_device(group: FlatGroup) -> bool:
    """Whether the group's master lives on a device other than the host (its update: torch's, whole-group)."""
    return group.work is not None and group.work.device.type != "cpu"
