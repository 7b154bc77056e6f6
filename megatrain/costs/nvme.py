"""The NVMe tier's arithmetic: which layers' state leaves host memory for a budget, and what its I/O costs.

What spills is the state only the optimizer update touches, read once and written once per step: Adam m and v
(8 B/param) and, with the exact hi/lo master, the 16-bit "lo" half (2 B/param; the bf16 "hi" half streams to
the device every forward and backward, so it stays). Gradient slabs are added into by every backward and read
by the global norm and the update, and the streamed masters by every layer load: three to four touches a step
against one, so they stay in host memory. A spilled layer's state lives in a file under `nvme_path` and is in
host memory only in one of `slots` ring buffers around its update (read ahead of it, written behind it).

Torch-free: read by the engine (engine/host/spill.py) and by the planner under the same rules.
"""

from __future__ import annotations

from dataclasses import dataclass

ALIGN = 4096  # bytes: file offsets, record sizes and buffers are multiples of it (direct I/O's rule)
PIECE_ALIGN = 256  # bytes: each tensor in a record starts on it (a vector kernel's loads never straddle)
ADAM_SPILL_BYTES = 8  # m and v, FP32, per parameter
LO_SPILL_BYTES = 2  # the hi/lo master's int16 half, per parameter


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def record_bytes(pieces: list[int]) -> int:
    """Bytes of one layer's record (its pieces, each 256-byte aligned), padded to a whole direct-I/O block."""
    return round_up(sum(round_up(p, PIECE_ALIGN) for p in pieces), ALIGN)


@dataclass(frozen=True)
class SpillPlan:
    """Which layers spill for a host budget, and what stays in host memory."""

    spilled: tuple[int, ...]  # layer indices whose update-only state lives on disk
    slots: int  # ring buffers that hold a spilled layer's state around its update (2: read-ahead overlaps)
    record: int  # bytes of the largest spilled layer's record (one ring buffer)
    fixed_bytes: int  # host bytes that never spill (streamed masters, gradient slabs, scratch, the globals)
    resident_bytes: int  # host bytes of the store with this plan: fixed + resident layers' state + the ring
    disk_bytes: int  # bytes under nvme_path
    need_bytes: int  # host bytes with nothing spilled
    minimum_bytes: int  # the smallest budget that can train: every layer spilled, one ring buffer

    @property
    def active(self) -> bool:
        return bool(self.spilled)


class BudgetTooSmall(ValueError):
    """host_budget_bytes below one layer's working set."""


def plan_spill(fixed_bytes: int, records: list[int], budget: int | None) -> SpillPlan:
    """The plan for a store whose non-spilling part takes `fixed_bytes` and whose layer i's spillable state takes
    `records[i]` bytes (record_bytes). `budget` None: spill every layer. Otherwise as few layers spill as let the
    rest fit beside the ring, spread evenly (_spread). Raises BudgetTooSmall naming the minimum."""
    need = fixed_bytes + sum(records)
    biggest = max(records, default=0)
    minimum = fixed_bytes + biggest
    if budget is not None and budget >= need:
        return SpillPlan((), 0, 0, fixed_bytes, need, 0, need, minimum)
    if budget is not None and budget < minimum:
        raise BudgetTooSmall(
            f"host_budget_bytes={budget} ({budget / 2**30:.3f} GiB) is below one layer's working set: the store's "
            f"non-spilling part takes {fixed_bytes} bytes and one layer's spilled state needs a {biggest}-byte "
            f"buffer, so the minimum is {minimum} bytes ({minimum / 2**30:.3f} GiB; {need} bytes with nothing "
            "spilled); raise host_budget_bytes to at least that")
    slots = 2 if budget is None or fixed_bytes + 2 * biggest <= budget else 1
    if len(records) < 2:
        slots = 1
    spilled = tuple(range(len(records))) if budget is None else _spread(records, budget - fixed_bytes - slots * biggest)
    record = max((records[i] for i in spilled), default=0)
    slots = min(slots, len(spilled))
    host = fixed_bytes + sum(r for i, r in enumerate(records) if i not in set(spilled)) + slots * record
    return SpillPlan(spilled, slots, record, fixed_bytes, host, sum(records[i] for i in spilled), need, minimum)


def _spread(records: list[int], room: int) -> tuple[int, ...]:
    """The layers to spill so the rest fit in `room`: as few as will do, spread evenly through the model, so the
    resident layers' updates between two spilled ones hide the disk (the next spilled layer is read ahead while
    they run, the last one written behind)."""
    L = len(records)
    for n in range(1, L + 1):
        picked = {int((k + 0.5) * L / n) for k in range(n)}
        if sum(r for i, r in enumerate(records) if i not in picked) <= room:
            return tuple(sorted(picked))
    return tuple(range(L))


def spill_bytes_per_param(hilo: bool) -> int:
    """Host bytes per decoder-layer parameter that move to disk when its layer spills."""
    return ADAM_SPILL_BYTES + (LO_SPILL_BYTES if hilo else 0)


def io_seconds(spilled_params: float, hilo: bool, nvme_gbs: float) -> float:
    """Seconds of disk I/O per step: every spilled byte read once and written once, at `nvme_gbs` GB/s each way
    (a disk's read and write share it: one figure for both, the slower one's to be safe)."""
    return 2 * spilled_params * spill_bytes_per_param(hilo) / (nvme_gbs * 1e9)


def check_nvme_settings(nvme_path: object, host_budget_bytes: object, nvme_gbps: object,
                        optimizer_in_backward: bool, data_parallel_host: str) -> None:
    """The NVMe tier's settings are well-formed and fit the other knobs (clear errors naming the fix)."""
    if nvme_path is not None and (not isinstance(nvme_path, str) or not nvme_path):
        raise ValueError(f"nvme_path={nvme_path!r} must be a directory path (a non-empty string) or None")
    budget = host_budget_bytes
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0):
        raise ValueError(f"host_budget_bytes={budget!r} must be an int > 0 (bytes) or None")
    # A budget without nvme_path is honoured by nodes sharing one store, or refused by the engine where nothing can
    # (engine/parallel/shared_store.py host_store): the ranks are not known here.
    if nvme_gbps is not None and (isinstance(nvme_gbps, bool) or not isinstance(nvme_gbps, int | float)
                                  or not 1e-4 <= nvme_gbps < float("inf")):
        raise ValueError(f"nvme_gbps={nvme_gbps!r} must be a finite rate >= 1e-4 GB/s (it emulates a slower disk), "
                         "or None for the disk's own speed")
    if nvme_gbps is not None and nvme_path is None:
        raise ValueError("nvme_gbps emulates the speed of the disk under nvme_path: set nvme_path too")
    if nvme_path is not None and optimizer_in_backward:
        raise ValueError("nvme_path does not combine with optimizer_in_backward (its updates run inside backward, "
                         "where no read-ahead fits); set optimizer_in_backward=false, and clipping works again")
    if nvme_path is not None and data_parallel_host == "shared":
        raise ValueError("nvme_path keeps each rank's own state on disk; the shared host store does not spill: "
                         "set data_parallel_host='replicated'")
