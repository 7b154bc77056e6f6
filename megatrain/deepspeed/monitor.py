"""`engine.monitor`: DeepSpeed's MonitorMaster, which MegaTrain does not feed.

DeepSpeed writes training events to TensorBoard, Weights & Biases, CSV or Comet when the config enables one; on
MegaTrain those sections are accepted, named as ignored at initialize, and the monitor is disabled: scripts that
check `engine.monitor.enabled` before `write_events` skip it, and a call anyway writes nothing.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Monitor"]


class Monitor:
    """`enabled` is False: no monitor backend is fed on MegaTrain (log with your own tracker)."""

    enabled = False

    def write_events(self, event_list: list[tuple[str, Any, int]]) -> None:
        return None  # disabled, as DeepSpeed's MonitorMaster with no backend configured
