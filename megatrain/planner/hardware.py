"""Hardware profiles (megatrain/data/hardware.yaml); what this machine has free right now is read by
megatrain/costs/host_memory.py (the engine's preflight reads it too)."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

GIB = 1024**3
GB = 1e9
HARDWARE_FILE = Path(__file__).resolve().parent.parent / "data" / "hardware.yaml"

# Numeric fields every profile must carry, each as {value, source}.
NUMERIC_FIELDS = (
    "peak_bf16_tflops", "peak_fp32_tflops", "sustained_bf16", "sustained_fp32",
    "device_memory_gib", "device_memory_bw_gbs", "device_reserved_gib",
    "link_gbs_theoretical", "link_gbs_achieved",
    "host_memory_gib", "host_memory_bw_gbs_theoretical", "host_memory_bw_gbs_achieved", "host_reserved_gib",
)
# host_optimizer_gbs: bytes/s of torch's fused CPU AdamW (megatrain's optimizer);
# cpu_adam_params_per_s: parameters/s of DeepSpeedCPUAdam on this host (ZeRO offload's optimizer),
# which is compute-bound rather than a DRAM stream, so it is a rate of its own.
OPTIONAL_NUMERIC_FIELDS = ("host_optimizer_gbs", "cpu_adam_params_per_s", "nvme_gbs", "nvme_gib")
# nvme_gbs: GB/s the NVMe tier's disk sustains for each of read and write (engine/host/spill.py); nvme_gib: its
# capacity. A profile without them plans no NVMe tier unless `plan --nvme-gbs` gives a rate.
# Fixed seconds per streamed layer per phase (forward; recompute + backward) on top of its FLOPs and
# elementwise traffic (weight binding, dispatch, events, the pipeline's work), and per micro-batch
# outside the layers (embedding, head/loss dispatch, global gradient adds). Every packaged profile
# carries the layer ones; a profile without a field (an older bench file) gets 0. Negative: refused.
# DeepSpeed ZeRO-3's host-side Python per call, beyond the bytes it moves (measured with real
# DeepSpeed by experiments/studies/zero3_mechanisms.py): one submodule's fetch + release hooks in one pass,
# one parameter's gradient hook, one gradient-bucket flush, and per gradient element of a flush the
# host work beyond the FP32 cast at DRAM speed (on a CPU "device" the reduce-scatter and copies run
# on the host too; on a GPU they run on the device and this is 0).
OVERHEAD_FIELDS = ("layer_overhead_fwd_s", "layer_overhead_bwd_s", "microbatch_overhead_s",
                   "zero3_module_hook_s", "zero3_param_grad_hook_s", "zero3_bucket_flush_s", "zero3_grad_elem_s")
# A multi-GPU node (planner/multi.py), all optional: a profile without them is a one-GPU node.
#   gpus_per_node       the most GPUs one node (one host) has: `plan --gpus-per-node` may not exceed it;
#   gpus_per_host_link  GPUs behind one host link (1: each its own x16 to a CPU root port; 2: pairs behind a
#                       PCIe switch with one x16 uplink), so each GPU streams at link / this when all do;
#   network_gbs         bytes/s per direction of the node's network to the other nodes, all NICs together
#                       (the inter-node gradient all-reduce); absent: a multi-node plan must be given one;
#   rank_runtime_gib    host memory each further rank process adds (python, torch, the device runtime's
#                       host side); the first is inside host_reserved_gib;
#   nvlink_gbs          bytes/s per direction one GPU's NVLink collectives reach (all-gather / reduce-scatter bus
#                       bandwidth, achieved); absent: no NVLink, the node keeps the per-rank path (docs/DISTRIBUTED.md);
#   nvlink_gpus         GPUs in one NVLink domain (8 on an NVSwitch board; 2 or 4 with H200 NVL bridges): a node of
#                       more GPUs gathers across domains over PCIe;
#   host_cores          the host's cores (torch's threads), where the planner's table (host_work.HOST_CORES) lacks it;
#   host_per_gpu (bool) each GPU has its own host (a Grace Hopper superchip): a node's host memory, bandwidth and
#                       cores are gpus_per_node times the profile's.
NODE_INT_FIELDS = ("gpus_per_node", "gpus_per_host_link", "nvlink_gpus", "host_cores")
NODE_FLOAT_FIELDS = ("network_gbs", "rank_runtime_gib", "nvlink_gbs")
# A process that imports torch and the engine holds about this much (see experiments/studies/scaling.py, which
# measures it as baseline PSS): the default for a profile that does not say.
DEFAULT_RANK_RUNTIME_GIB = 0.5


@dataclass(frozen=True)
class Hardware:
    name: str
    description: str
    link: str
    unified_memory: bool
    peak_bf16_tflops: float
    peak_fp32_tflops: float
    sustained_bf16: float
    sustained_fp32: float
    device_memory_gib: float
    device_memory_bw_gbs: float
    device_reserved_gib: float
    link_gbs_theoretical: float
    link_gbs_achieved: float
    host_memory_gib: float
    host_memory_bw_gbs_theoretical: float
    host_memory_bw_gbs_achieved: float
    host_reserved_gib: float
    host_optimizer_gbs: float | None = None
    cpu_adam_params_per_s: float | None = None
    nvme_gbs: float | None = None
    nvme_gib: float | None = None
    layer_overhead_fwd_s: float = 0.0
    layer_overhead_bwd_s: float = 0.0
    microbatch_overhead_s: float = 0.0
    zero3_module_hook_s: float = 0.0
    zero3_param_grad_hook_s: float = 0.0
    zero3_bucket_flush_s: float = 0.0
    zero3_grad_elem_s: float = 0.0
    gpus_per_node: int = 1
    gpus_per_host_link: int = 1
    network_gbs: float | None = None
    rank_runtime_gib: float = DEFAULT_RANK_RUNTIME_GIB
    nvlink_gbs: float | None = None
    nvlink_gpus: int = 1
    host_cores: int | None = None
    host_per_gpu: bool = False
    sources: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def peak_flops(self, dtype: str) -> float:
        return 1e12 * (self.peak_bf16_tflops if _is_bf16(dtype) else self.peak_fp32_tflops)

    def sustained_flops(self, dtype: str) -> float:
        frac = self.sustained_bf16 if _is_bf16(dtype) else self.sustained_fp32
        return self.peak_flops(dtype) * frac

    @property
    def link_bps(self) -> float:
        return self.link_gbs_achieved * GB

    @property
    def host_bw_bps(self) -> float:
        return self.host_memory_bw_gbs_achieved * GB

    @property
    def optimizer_bps(self) -> float:
        return (self.host_optimizer_gbs or self.host_memory_bw_gbs_achieved) * GB

    @property
    def device_bytes(self) -> int:
        return int(self.device_memory_gib * GIB)

    @property
    def host_bytes(self) -> int:
        return int(self.host_memory_gib * GIB)

    def with_(self, **changes: Any) -> Hardware:
        """A copy with some numbers replaced (e.g. an emulated link rate, a smaller host)."""
        srcs = dict(self.sources)
        for k in changes:
            srcs[k] = "override"
        return dataclasses.replace(self, sources=srcs, **changes)


def _is_bf16(dtype: str) -> bool:
    d = str(dtype).replace("torch.", "")
    if d in ("bfloat16", "bf16"):
        return True
    if d in ("float32", "fp32"):
        return False
    raise ValueError(f"compute dtype {dtype!r} is not supported by the planner; use 'bfloat16' or 'float32'")


def load_profiles(path: str | os.PathLike | None = None) -> dict[str, Hardware]:
    """All profiles in a hardware YAML file (the packaged one by default), validated."""
    raw = load_raw(path)
    shared = raw.get("sources") or {}
    out = {}
    for name, entry in (raw.get("profiles") or {}).items():
        out[name] = profile_from_dict(name, entry, shared)
    return out


def load_raw(path: str | os.PathLike | None = None) -> dict[str, Any]:
    p = Path(path) if path is not None else HARDWARE_FILE
    st = p.stat()
    return copy.deepcopy(_parse(str(p), st.st_mtime_ns, st.st_size))


@functools.lru_cache(maxsize=8)
def _parse(path: str, mtime_ns: int, size: int) -> dict[str, Any]:
    # keyed on mtime and size so an edited or re-benched file is read again; plans call this a lot
    with open(path) as f:
        return yaml.safe_load(f) or {}


def profile_from_dict(name: str, entry: dict[str, Any], shared_sources: dict[str, str] | None = None) -> Hardware:
    """Build a Hardware from one YAML entry (or a `bench` result); every number must cite a source."""
    if not isinstance(entry, dict):
        raise ValueError(f"hardware profile {name!r} is not a mapping (got {type(entry).__name__})")
    shared_sources = shared_sources or {}
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key in NUMERIC_FIELDS + OPTIONAL_NUMERIC_FIELDS:
        if key not in entry:
            if key in OPTIONAL_NUMERIC_FIELDS:
                continue
            raise ValueError(f"hardware profile {name!r} lacks {key!r}")
        item = entry[key]
        value = _sourced(name, key, item, shared_sources, sources)
        if not value > 0:
            raise ValueError(f"hardware profile {name!r}: {key}={value} must be > 0")
        values[key] = value
    for key in OVERHEAD_FIELDS:
        if key not in entry:
            continue
        item = entry[key]
        value = _sourced(name, key, item, shared_sources, sources)
        if not value >= 0:
            raise ValueError(f"hardware profile {name!r}: {key}={value} must be >= 0")
        values[key] = value
    values.update(_node_fields(name, entry, shared_sources, sources))
    return Hardware(
        name=name,
        description=str(entry.get("description", "")),
        link=str(entry.get("link", "")),
        unified_memory=bool(entry.get("unified_memory", False)),
        host_per_gpu=bool(entry.get("host_per_gpu", False)),
        sources=sources,
        **values,
    )


def _sourced(name: str, key: str, item: Any, shared_sources: dict[str, str], sources: dict[str, str]) -> float:
    """The value of one `{value: N, source: ...}` field (its source recorded in `sources`)."""
    if not isinstance(item, dict) or "value" not in item or not item.get("source"):
        raise ValueError(f"hardware profile {name!r}: {key} must be {{value: N, source: ...}} (got {item!r})")
    src = str(item["source"])
    sources[key] = shared_sources.get(src, src)
    return float(item["value"])


def _node_fields(name: str, entry: dict[str, Any], shared_sources: dict[str, str],
                 sources: dict[str, str]) -> dict[str, Any]:
    """The optional multi-GPU node fields of one entry, validated; sources are recorded in `sources`."""
    out: dict[str, Any] = {}
    for key in NODE_INT_FIELDS + NODE_FLOAT_FIELDS:
        if key not in entry:
            continue
        item = entry[key]
        value = _sourced(name, key, item, shared_sources, sources)
        if key in NODE_INT_FIELDS:
            if value != int(value) or value < 1:
                raise ValueError(f"hardware profile {name!r}: {key}={item['value']!r} must be a whole number >= 1")
            out[key] = int(value)
        else:
            if not value > 0:
                raise ValueError(f"hardware profile {name!r}: {key}={value} must be > 0")
            out[key] = value
    if out.get("nvlink_gpus", 1) > 1 and "nvlink_gbs" not in out:
        raise ValueError(f"hardware profile {name!r}: nvlink_gpus={out['nvlink_gpus']} without nvlink_gbs (the "
                         "NVLink collectives' GB/s per direction per GPU)")
    if out.get("gpus_per_host_link", 1) > out.get("gpus_per_node", 1):
        raise ValueError(f"hardware profile {name!r}: gpus_per_host_link={out['gpus_per_host_link']} exceeds "
                         f"gpus_per_node={out.get('gpus_per_node', 1)}")
    return out


def get_hardware(hw: str | Hardware | dict[str, Any], path: str | os.PathLike | None = None) -> Hardware:
    """A profile by name (e.g. 'h200-pcie'), or pass a Hardware / a bench result dict through."""
    if isinstance(hw, Hardware):
        return hw
    if isinstance(hw, dict):
        return profile_from_dict(str(hw.get("name", "custom")), hw)
    profiles = load_profiles(path)
    if hw in profiles:
        return profiles[hw]
    close = difflib.get_close_matches(str(hw), list(profiles), n=3)
    hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
    raise ValueError(f"unknown hardware profile {hw!r}.{hint} Known profiles: {', '.join(profiles)}.")


def resolve_hardware(hardware: Any, link_gbs: float | None, host_memory_gib: float | None,
                     device_memory_gib: float | None) -> Hardware:
    """get_hardware, with the user's overrides of the link rate and the memory sizes (None: the profile's)."""
    hw = get_hardware(hardware)
    changes: dict[str, Any] = {}
    if link_gbs is not None:
        changes["link_gbs_achieved"] = float(link_gbs)
    if host_memory_gib is not None:
        changes["host_memory_gib"] = float(host_memory_gib)
    if device_memory_gib is not None:
        changes["device_memory_gib"] = float(device_memory_gib)
    return hw.with_(**changes) if changes else hw


