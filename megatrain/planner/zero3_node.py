"""DeepSpeed ZeRO-3 offload on G GPUs per node and N nodes, from its mechanisms (zero3_model.py on one GPU).

As DeepSpeed 0.19.8 runs it with offload_param and offload_optimizer to the CPU:
- every parameter is partitioned across all W = G N ranks; a fetch copies this rank's partition host->device
  (1/W of the parameter over its own link) and all-gathers the rest (NCCL: within the node over NVLink, or over
  PCIe where the GPUs have none; across nodes over the rank's share of the network). The copy and the gather of
  one fetch run one after the other, so a fetched element costs the sum of the three;
- each submodule's hooks, the lookahead and the event limit are one GPU's (every rank runs every module);
- gradient buckets are reduce-scattered on the GPUs (the compute dtype) and each rank's partition goes to the
  host, the same sum per element as a fetch;
- each rank's DeepSpeedCPUAdam updates its 1/W of the model with 1/G of the node's cores: the node's measured
  parameters/s over P/N parameters (the same time as one GPU over P when N = 1).
Host memory: the model's FP32 master, gradient and Adam state partitioned, so held once per node (1/N of it with
N nodes), plus each rank's process and pinned buffers. Device memory: one GPU's (its working set and buffers).
"""

from __future__ import annotations

import dataclasses
import math

from .hardware import GB, GIB, Hardware
from .memory import Memory, check_fit
from .point import Point
from .prediction import Plan
from .step_time import zero3_time


def fetch_rate_bps(hw: Hardware, gpus: int, nodes: int, link_bps: float) -> float:
    """Bytes of a parameter per second one fetch delivers to a GPU (partition copy, then the gathers)."""
    W = gpus * nodes
    d = min(hw.nvlink_gpus, gpus) if hw.nvlink_gbs else 1
    per_byte = 1 / (W * link_bps)  # its own partition over its link
    if d > 1:
        per_byte += (d - 1) / gpus / (hw.nvlink_gbs * GB)  # within its NVLink domain
    per_byte += (gpus - d) / gpus / link_bps  # other domains' (or, without NVLink, every other GPU's) over PCIe
    if nodes > 1:
        per_byte += (nodes - 1) / nodes / ((hw.network_gbs or 0.0) * GB / gpus)  # other nodes', its NIC share
    return 1 / per_byte


def zero3_rank(p: Point, single: Plan, hw: Hardware, rhw: Hardware, gpus: int, nodes: int) -> tuple[Plan, str]:
    """(one rank's Plan, how its data moves) for ZeRO-3 offload on `gpus` per node x `nodes`; `single`: its one-GPU
    plan, `hw`: the node's profile, `rhw`: one GPU's view of the node (planner/multi.py rank_hardware)."""
    rate = fetch_rate_bps(hw, gpus, nodes, rhw.link_bps)
    adam = (hw.cpu_adam_params_per_s or 0.0) * nodes or None  # the whole node's rate over 1/N of the model
    view = rhw.with_(link_gbs_achieved=rate / GB, cpu_adam_params_per_s=adam,
                     host_memory_bw_gbs_achieved=hw.host_memory_bw_gbs_achieved * nodes)
    t = zero3_time(p, view)
    # the link carried only the partitions: report its own bytes
    t = dataclasses.replace(t, h2d_bytes=int(t.h2d_bytes / (gpus * nodes)), d2h_bytes=int(t.d2h_bytes / (gpus * nodes)))
    mem = single.memory
    state = ("master weights", "gradients", "adam m", "adam v", "params (compute dtype)", "fp32 model")
    host = {k: (math.ceil(v / nodes) if any(s in k for s in state) else v) for k, v in mem.host.items()}
    host["rank runtime (x further ranks)"] = int((gpus - 1) * hw.rank_runtime_gib * GIB)
    node_mem = Memory(host, dict(mem.device), mem.unified, mem.shared, mem.pinned)
    ok, reasons = check_fit(node_mem, hw)
    reasons = [r.replace("host:", f"host (per node, {gpus} GPUs):", 1) for r in reasons]
    rank = Plan(p, view, node_mem, t, ok, reasons, dict(single.decisions), list(single.warnings), None,
                list(single.refused))
    how = (f"DeepSpeed's partitions: 1/{gpus * nodes} of each parameter over the link, the rest all-gathered "
           + ("over NVLink" if hw.nvlink_gbs else "over PCIe") + (" and the network" if nodes > 1 else ""))
    return rank, how
