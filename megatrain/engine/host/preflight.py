"""Host-memory preflight: refuse a store that cannot fit before allocating any of it; what host mode "auto" needs to
know of the model about to be placed (`host_facts`: the rule is costs/host_mode.py's, the planner's too, applied by
megatrain/config/settle.py)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ...config.settle import HostFacts, settle_host_mode
from ...costs.host_mode import HostMode
from ...costs.modes import GRAD_BYTES, MASTER_BYTES, GradSlab, HostMaster, rollback_bytes_per_param
from ...costs.nvme import spill_bytes_per_param
from ...costs.pinning import pinned_bytes
from ...costs.rollback import layers_that_fit

# Host bytes per parameter, by component (FP32 master + gradient slab + Adam m and v).
HOST_BYTES_PER_PARAM = {"master": 4, "grad": 4, "adam_m": 4, "adam_v": 4}
SHADOW_BYTES_PER_PARAM = 2  # bf16 copy that streams to the device in bf16 compute mode


class HostMemoryError(MemoryError):
    """The host store would not fit in the memory this process may use."""


def available_host_bytes() -> int:
    """What this process may still allocate: the cgroup's headroom when a limit is set (its reclaimable page
    cache not counted as used), capped by MemAvailable; the planner's reading (planner/hardware.py)."""
    from ...costs.host_memory import host_memory_available

    try:
        return host_memory_available().available_bytes
    except RuntimeError:  # no /proc/meminfo and no cgroup limit
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def model_host_bytes(params: list[torch.Tensor]) -> int:
    """Host bytes the model's own parameters hold, each storage once (tied weights share one): what placement
    frees as it packs them into the store, so the store may use them."""
    seen: dict[int, int] = {}
    for p in params:
        if p.device.type == "cpu":
            st = p.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def host_store_bytes(n_params: int, compute_dtype: torch.dtype, n_layer_params: int,
                     master: HostMaster = HostMaster.FP32, grad: GradSlab | None = GradSlab.FLOAT32) -> dict[str, int]:
    need = {k: v * n_params for k, v in HOST_BYTES_PER_PARAM.items()}
    if master is not HostMaster.FP32 or grad is not GradSlab.FLOAT32:
        # The modes change the layers' master and slab only (modes.py); the globals keep FP32 both.
        n_glob = n_params - n_layer_params
        need["master"] = MASTER_BYTES[master] * n_layer_params + 4 * n_glob
        need["grad"] = (GRAD_BYTES[grad] * n_layer_params if grad is not None else 0) + 4 * n_glob
    if compute_dtype == torch.bfloat16 and master is HostMaster.FP32:
        need["bf16_shadow"] = SHADOW_BYTES_PER_PARAM * n_layer_params
    return need


def pinned_preflight(layer_shapes: list[list[tuple[str, torch.Size]]], global_shapes: list[torch.Size],
                     compute_dtype: torch.dtype, staging: bool) -> dict[str, int]:
    """Exactly the bytes the host store (and, with `staging`, the CUDA gradient staging) will pin, by
    component: the same rule (costs/pinning.py) the store pins by."""
    layer_numels = [sum(torch.Size(s).numel() for _, s in shapes) for shapes in layer_shapes]
    itemsize = torch.empty((), dtype=compute_dtype).element_size()
    return pinned_bytes(layer_numels, sum(torch.Size(s).numel() for s in global_shapes),
                        2 if compute_dtype == torch.bfloat16 else 4, staging, itemsize)


def host_preflight(layer_shapes: list[list[tuple[str, torch.Size]]], global_shapes: list[torch.Size],
                   compute_dtype: torch.dtype, available: int | None = None, pin: bool = False,
                   staging: bool = False, master: HostMaster = HostMaster.FP32,
                   grad: GradSlab | None = GradSlab.FLOAT32, freed: int = 0) -> dict[str, int]:
    """Host bytes by component; raises HostMemoryError before anything is allocated when they do not fit.
    `staging`: the engine runs on CUDA, where gradients land in staging slots (pinned with `pin`);
    `master` / `grad`: the host-memory mode of the layers (modes.py); `freed`: the model's own host bytes,
    which placement frees as it packs them (model_host_bytes).

    The store's pages are touched as it is filled, after each tensor of the model is freed, so the model's
    bytes count as available to it; what is pinned is touched at once, while the model is still whole, so it
    must fit without them."""
    n_layer = sum(torch.Size(s).numel() for shapes in layer_shapes for _, s in shapes)
    n = n_layer + sum(torch.Size(s).numel() for s in global_shapes)
    need = host_store_bytes(n, compute_dtype, n_layer, master, grad)
    if staging:  # host memory of its own, beside the store (pinned with `pin`)
        staged = pinned_preflight(layer_shapes, global_shapes, compute_dtype, True)
        need.update({k: staged[k] for k in ("grad staging", "resident grad staging", "resident upload staging")
                     if k in staged})
    avail = available_host_bytes() if available is None else available
    total = sum(need.values())
    # The store's pinned share is touched when it is allocated, before the model's tensors are freed.
    pinned = sum(pinned_preflight(layer_shapes, global_shapes, compute_dtype, staging).values()) if pin else 0
    if total > avail + freed or pinned > avail:
        parts = ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in need.items())
        if pin:  # a share of the terms above, not in addition to them
            parts += f"; {pinned / 2**30:.2f} GiB of it pinned"
        room = f"only {avail / 2**30:.2f} GiB is available"
        if freed:
            room += (f", plus the model's own {freed / 2**30:.2f} GiB that placement frees"
                     + (" (not for the pinned share, pinned while the model is still whole)" if pin else ""))
        raise HostMemoryError(
            f"the host store needs {total / 2**30:.2f} GiB ({parts}; {n / 1e9:.2f}B parameters) but {room}; use a "
            "smaller model, a machine with more host memory, raise the container's memory limit, or set nvme_path "
            "(the NVMe tier keeps the optimizer state of the layers that do not fit on disk; `megatrain plan` "
            "says how much)")
    return need


def rollback_layers(layer_numels: Sequence[int], master: HostMaster, bf16_compute: bool, required: bool,
                    available: int | None = None) -> int:
    """How many of the layers (their parameter counts, in the order they would be speculated) have a rollback copy
    (costs/modes.py rollback_bytes_per_param: the master and Adam state) that fits what the host has left once the
    store is built, taken in that order until the next does not fit. `required` (speculative_step=True): every
    layer's, or HostMemoryError."""
    per_param = rollback_bytes_per_param(master, bf16_compute)
    avail = available_host_bytes() if available is None else available
    count = layers_that_fit(layer_numels, per_param, avail)
    if required and count < len(layer_numels):
        total = per_param * sum(layer_numels)
        raise HostMemoryError(
            f"speculative_step=True keeps a rollback copy of every host-updated layer's master and Adam state, "
            f"{total / 2**30:.2f} GiB, but only {avail / 2**30:.2f} GiB of host memory is left (room for {count} of "
            f"{len(layer_numels)} layers); set speculative_step='auto' (as many layers as fit) or False")
    return count


def rollback_preflight(n_layer_params: int, master: HostMaster, bf16_compute: bool, required: bool,
                       available: int | None = None) -> bool:
    """Whether one rollback copy of `n_layer_params` parameters (every layer's at once) fits, as rollback_layers
    measures it; `required`: HostMemoryError when it does not, instead of False."""
    return rollback_layers([n_layer_params], master, bf16_compute, required, available) == 1


def host_facts(config: Any, model: nn.Module, layers: nn.Module, accumulation_one: bool = True,
               available: int | None = None, agree: Callable[[int], int] | None = None) -> HostFacts:
    """What host mode "auto" needs to know of this model on this host (megatrain/config/settle.py HostFacts): a mode
    fits when its store (host_store_bytes) fits what this process may allocate, the model's own host bytes counted as
    freed (as the preflight counts them); an NVMe mode when what never spills does (the spilled layers' state leaves
    the host but for one layer's ring buffer). `agree` (data parallel: the largest of the ranks' values): the ranks
    take the latest candidate any of them chose, since each reads its own free memory and they must hold one mode."""
    dtype = torch.bfloat16 if config.compute_dtype == "bfloat16" else torch.float32
    sizes: list[int] = []

    def fits(mode: HostMode) -> bool:
        if not sizes:  # read when a mode is first weighed: a plan whose host mode is set reads nothing
            layer_ids = {id(p) for p in layers.parameters()}
            params = list({id(p): p for p in model.parameters()}.values())
            sizes.extend((sum(p.numel() for p in params if id(p) in layer_ids), sum(p.numel() for p in params),
                          max((sum(p.numel() for p in layer.parameters()) for layer in layers), default=0),
                          (available_host_bytes() if available is None else available) + model_host_bytes(params)))
        n_layer, n, biggest, room = sizes
        need = sum(host_store_bytes(n, dtype, n_layer, mode.master,
                                    None if config.optimizer_in_backward else mode.grad).values())
        if mode.nvme:
            need -= (n_layer - biggest) * spill_bytes_per_param(mode.master is HostMaster.HILO)
        return need <= room

    return HostFacts(fits, accumulation_one, agree)


def auto_host_mode(config: Any, model: nn.Module, layers: nn.Module, accumulation_one: bool = True,
                   available: int | None = None, agree: Callable[[int], int] | None = None) -> Any:
    """`config` with host mode "auto" settled for this model on this host (megatrain/config/settle.py
    settle_host_mode with `host_facts`), the rule the engine's plan takes; unchanged when nothing is "auto"."""
    return settle_host_mode(config, host_facts(config, model, layers, accumulation_one, available, agree))
