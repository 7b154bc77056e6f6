"""`engine.tput_timer`: DeepSpeed's ThroughputTimer on MegaTrain's engine, with its attributes and verbs.

The engine starts it at each training forward and stops it at each `step()` (a global step at an accumulation
boundary), as DeepSpeed's engine does; scripts call `update_epoch_count()` at an epoch's end and read
`avg_samples_per_sec()`. The first `start_step` global steps are not timed (warm-up), as DeepSpeed's; with
`steps_per_print` set it logs samples per second at those steps.
"""

from __future__ import annotations

import time

from .accelerator import get_accelerator
from .utils import log_visible

__all__ = ["ThroughputTimer"]


class ThroughputTimer:
    """Samples per second over the training steps after the first `start_step`."""

    def __init__(self, batch_size: int, start_step: int = 2, steps_per_output: int | None = None,
                 synchronized: bool = True) -> None:
        self.batch_size = batch_size
        self.start_step = start_step
        self.steps_per_output = steps_per_output
        self.synchronized = synchronized
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0
        self.start_time = 0.0
        self.end_time = 0.0
        self.started = False

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        self.started = True
        if self.global_step_count >= self.start_step:
            if self.synchronized:
                get_accelerator().synchronize()
            self.start_time = time.time()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        if not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time <= 0:
            return
        if self.synchronized:
            get_accelerator().synchronize()
        self.end_time = time.time()
        duration = self.end_time - self.start_time
        self.total_elapsed_time += duration
        self.step_elapsed_time += duration
        if global_step:
            if report_speed and self.steps_per_output and self.global_step_count % self.steps_per_output == 0:
                log_visible("epoch=%d/micro_step=%d/global_step=%d, RunningAvgSamplesPerSec=%s, CurrSamplesPerSec=%s",
                            self.epoch_count, self.micro_step_count, self.global_step_count,
                            self.avg_samples_per_sec(), self.batch_size / max(self.step_elapsed_time, 1e-12))
            self.step_elapsed_time = 0.0

    def avg_samples_per_sec(self) -> float:
        """Training samples per second over the timed steps (-inf before the first global step)."""
        timed = self.global_step_count - self.start_step
        if self.global_step_count > 0 and timed > 0 and self.total_elapsed_time > 0:
            return self.batch_size / (self.total_elapsed_time / timed)
        return float("-inf")
