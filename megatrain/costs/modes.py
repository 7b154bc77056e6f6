"""Host-memory modes: what a master value is made of, and what holds a layer's gradient until the update.

One definition, read by the engine (store, gradient path, optimizer) and by the planner under the same
names, so a plan and a run cannot disagree about what a mode costs. No imports from the engine: the
planner uses this module without pulling engine code in.
"""

from __future__ import annotations

from enum import Enum


class HostMaster(str, Enum):
    """What each decoder-layer master value is made of in host memory."""

    FP32 = "fp32"  # FP32 master (+ a bf16 shadow that streams when computing in bf16)
    HILO = "hilo"  # exact split: bf16 "hi" (streams as is) + 16-bit "lo" remainder; FP32 bit for bit
    BF16 = "bf16"  # bf16 only, updated in place (the paper's code): not exact

    @property
    def exact(self) -> bool:
        return self is not HostMaster.BF16


class GradSlab(str, Enum):
    """The dtype of the host gradient slab of each decoder layer."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"  # exact with bf16 compute and one micro-batch per step (autograd returns bf16)


# Host bytes per decoder-layer parameter of each part, by mode (the globals, embedding/norm/head, always keep
# an FP32 master and an FP32 gradient: they are resident on the device and a small share of a large model).
MASTER_BYTES = {HostMaster.FP32: 4, HostMaster.HILO: 4, HostMaster.BF16: 2}
GRAD_BYTES = {GradSlab.FLOAT32: 4, GradSlab.BFLOAT16: 2}
ADAM_BYTES = 8  # m and v, FP32
SHADOW_BYTES = 2  # the bf16 copy that streams, only for an FP32 master with bf16 compute


def layer_bytes_per_param(master: HostMaster, grad: GradSlab, optimizer_in_backward: bool, bf16_compute: bool) -> int:
    """Host bytes per decoder-layer parameter that the store, the slabs and Adam hold for the whole run."""
    shadow = SHADOW_BYTES if master is HostMaster.FP32 and bf16_compute else 0
    slab = 0 if optimizer_in_backward else GRAD_BYTES[grad]
    return MASTER_BYTES[master] + shadow + slab + ADAM_BYTES


def rollback_bytes_per_param(master: HostMaster, bf16_compute: bool) -> int:
    """Host bytes per decoder-layer parameter the speculative step keeps to roll an update back bit for bit: a
    copy of what the update writes (the master or its halves, the streamed bf16 copy of an FP32 master, m and v)."""
    shadow = SHADOW_BYTES if master is HostMaster.FP32 and bf16_compute else 0
    return MASTER_BYTES[master] + shadow + ADAM_BYTES


def parse(enum: type[Enum], value: object, knob: str) -> Enum:
    """`value` as a member of `enum`, or a clear error naming the knob and its choices."""
    if isinstance(value, enum):
        return value
    try:
        return enum(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in enum)
        raise ValueError(f"{knob}={value!r} is not a mode; use one of {choices}") from None
