"""The engine's parts one at a time, for the studies and the GPU check that measure them apart from a step.

Training code never needs these (`megatrain.engine`'s own names are the engine's API); a benchmark of the host
kernels, the copy streams or the stores does, and reaches them here rather than inside the wings.
"""

from __future__ import annotations

from .host import hilo, reduce_kernel
from .host.pinned import host_buffer
from .host.preflight import available_host_bytes, pinned_preflight
from .host.slab_state import PartsAdd, SlabState
from .host.spill import SpillFile
from .host.store import FlatGroup, Scratch
from .model import probe
from .model.probe import Verdict
from .pipeline.activations import ActivationStore
from .pipeline.schedule import REDUCE_CHUNK, accumulate
from .runtime.malloc import release_free_heap
from .runtime.memtrack import DeviceMemoryTracker, host_allocations
from .runtime.stream import DONE, CopyStream, Streams, Trace, side_threads
from .runtime.threads import set_team
from .update import adam_kernel, choose, fused, update

__all__ = ["DONE", "REDUCE_CHUNK", "ActivationStore", "CopyStream", "DeviceMemoryTracker", "FlatGroup", "PartsAdd",
           "Scratch", "SlabState", "SpillFile", "Streams", "Trace", "Verdict", "accumulate", "adam_kernel",
           "available_host_bytes", "choose", "fused", "hilo", "host_allocations", "host_buffer", "pinned_preflight", "probe",
           "reduce_kernel", "release_free_heap", "set_team", "side_threads", "update"]
