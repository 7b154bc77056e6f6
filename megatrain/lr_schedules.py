"""DeepSpeed's warm-up learning-rate schedules, reimplemented to give the same numbers.

A script that names `WarmupLR`, `WarmupDecayLR` or `WarmupCosineLR` in its DeepSpeed config must see
the very same learning rate at every step under MegaTrain, start-up included: DeepSpeed sets the
optimizer's lr to the schedule's value at iteration -1 when the schedule is built (so the first
optimizer step runs at `warmup_min_lr`, not at the optimizer's own lr), and steps the schedule once
per optimizer step. The arithmetic below keeps DeepSpeed's operation order so that the floats agree
bit for bit, which the tests check against DeepSpeed's own classes.

The schedules work on any `torch.optim.Optimizer` (or an object wrapping one as `.optimizer`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.optim import Optimizer

WARMUP_TYPES = ("log", "linear")

__all__ = ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "LRRangeTest", "OneCycle", "SCHEDULES", "WARMUP_TYPES"]


def _torch_optimizer(optimizer: Any) -> Optimizer:
    if isinstance(optimizer, Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, Optimizer):
        return inner
    raise TypeError(f"{type(optimizer).__name__} is not a torch.optim.Optimizer (nor wraps one as .optimizer)")


def _per_group(optimizer: Optimizer, value: float | Sequence[float], name: str) -> list[float]:
    n = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name}: expected {n} values (one per param group), got {len(value)}")
        return list(value)
    return [value] * n


def _check_steps(name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_warmup_type(warmup_type: str) -> None:
    # DeepSpeed falls back to "log" with a warning on an unknown type; a typo here silently changes
    # the whole warm-up curve, so refuse it instead.
    if warmup_type not in WARMUP_TYPES:
        raise ValueError(f"warmup_type={warmup_type!r} is not one of {WARMUP_TYPES}")


def _write_lrs(optimizer: Optimizer, lrs: list[float]) -> list[float]:
    for group, lr in zip(optimizer.param_groups, lrs):
        if torch.is_tensor(group["lr"]):
            # A tensor lr (capturable/compiled optimizers) must keep its identity.
            group["lr"].fill_(lr.squeeze() if torch.is_tensor(lr) else lr)
        else:
            group["lr"] = lr
    return [group["lr"] for group in optimizer.param_groups]


class _Schedule:
    """Shared stepping and state handling; subclasses define `get_lr()` for `last_batch_iteration`."""

    optimizer: Optimizer
    last_batch_iteration: int

    def _start(self, last_batch_iteration: int) -> None:
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] | None = None
        # Only a fresh schedule writes its start value; a resumed one (iteration given) leaves the
        # optimizer's lr as restored from its own state dict, exactly as DeepSpeed does.
        if last_batch_iteration == -1:
            self._last_lr = _write_lrs(self.optimizer, self.get_lr())

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def step(self, last_batch_iteration: int | None = None) -> None:
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = _write_lrs(self.optimizer, self.get_lr())

    def get_last_lr(self) -> list[float]:
        if self._last_lr is None:
            raise RuntimeError("get_last_lr() needs a step() first (the schedule was built with an explicit iteration)")
        return self._last_lr

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.last_batch_iteration = sd["last_batch_iteration"]

    def _warmup_fraction(self) -> float:
        """Warm-up progress in [0, 1) for iteration < warmup_num_steps."""
        it = self.last_batch_iteration
        if self.warmup_type == "log":
            return self.inverse_log_warm_up * math.log(it + 1)
        return it / self.warmup_num_steps

    def __repr__(self) -> str:
        return f"{type(self).__name__}(last_batch_iteration={self.last_batch_iteration})"


class WarmupLR(_Schedule):
    """lr rises from `warmup_min_lr` to `warmup_max_lr` over `warmup_num_steps`, then stays.

    `warmup_max_lr=None` means each group's current lr. The log curve is
    `min + (max - min) * log(it + 1) / log(W)`, the linear one `min + (max - min) * it / W`, with
    `W = max(2, warmup_num_steps)` as in DeepSpeed.
    """

    def __init__(
        self,
        optimizer: Any,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        _check_steps("warmup_num_steps", warmup_num_steps)
        _check_warmup_type(warmup_type)
        self.optimizer = _torch_optimizer(optimizer)
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in self.optimizer.param_groups]
        self.min_lrs = _per_group(self.optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(self.optimizer, warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs)]
        # log(1) would divide by zero: DeepSpeed warms up over at least two steps.
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self._start(last_batch_iteration)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_fraction()
        return 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + (delta * gamma) for lo, delta in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """`WarmupLR`, then a linear decay that reaches 0 at `total_num_steps`.

    Note DeepSpeed's default `warmup_max_lr` here is 0.001, not the optimizer's lr.
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        _check_steps("total_num_steps", total_num_steps)
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_fraction()
        remaining = float(self.total_num_steps - self.last_batch_iteration)
        return max(0.0, remaining / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_Schedule):
    """Scales each group's initial lr by a ratio: warm-up from `warmup_min_ratio` to 1, then a cosine
    down to `cos_min_ratio` at `total_num_steps` (held there afterwards)."""

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        _check_steps("warmup_num_steps", warmup_num_steps)
        _check_steps("total_num_steps", total_num_steps)
        _check_warmup_type(warmup_type)
        self.optimizer = _torch_optimizer(optimizer)
        self.total_num_steps = total_num_steps
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = warmup_type
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        # The base lrs are read once, before the schedule overwrites them.
        self.org_lrs = [g["lr"].clone() if torch.is_tensor(g["lr"]) else g["lr"] for g in self.optimizer.param_groups]
        self._start(last_batch_iteration)

    def get_lr_ratio(self) -> float:
        it = self.last_batch_iteration
        if it < 0:
            return 0.0
        if it < self.warmup_num_steps:
            return self.warmup_min_ratio + self._warmup_fraction() * (1.0 - self.warmup_min_ratio)
        done = it - self.warmup_num_steps + 1
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        # Clamped so the ratio stays at the floor past the end instead of rising again.
        progress = min(1.0, done / span)
        wave = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * wave)

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


class LRRangeTest(_Schedule):
    """The LR range test: lr = min_lr x (1 + step_rate x k), k = (iteration + 1) / step_size, rounded down when
    `lr_range_test_staircase`; used to find the largest lr that still trains."""

    def __init__(self, optimizer: Any, lr_range_test_min_lr: float | Sequence[float] = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1) -> None:
        self.optimizer = _torch_optimizer(optimizer)
        self.min_lr = _per_group(self.optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        if isinstance(lr_range_test_step_size, bool) or not isinstance(lr_range_test_step_size, int) \
                or lr_range_test_step_size <= 0:
            raise ValueError(f"lr_range_test_step_size must be a positive int, got {lr_range_test_step_size!r}")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        self._start(last_batch_iteration)

    def get_lr(self) -> list[float]:
        k = float(self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            k = math.floor(k)
        increase = 1 + self.step_rate * k
        return [lr * increase for lr in self.min_lr]


class OneCycle(_Schedule):
    """The 1-cycle policy: lr climbs from `cycle_min_lr` to `cycle_max_lr` over `cycle_first_step_size`
    iterations and back over `cycle_second_step_size` (optionally in stairs), then decays by
    `decay_lr_rate` every `decay_step_size`; with `cycle_momentum`, Adam's beta1 moves the opposite way
    between `cycle_max_mom` and `cycle_min_mom`.

    As in DeepSpeed, cycling momentum writes each group's betas as `(momentum, 0.99)`: beta2 becomes 0.99
    whatever the optimizer had. With an optimizer that has no `betas` (SGD), momentum is not cycled.
    """

    def __init__(self, optimizer: Any, cycle_min_lr: float | Sequence[float], cycle_max_lr: float | Sequence[float],
                 decay_lr_rate: float = 0.0, cycle_first_step_size: int = 2000,
                 cycle_second_step_size: int | None = None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: int | None = None, decay_step_size: int = 0,
                 cycle_momentum: bool = True, cycle_min_mom: float | Sequence[float] = 0.8,
                 cycle_max_mom: float | Sequence[float] = 0.9, decay_mom_rate: float = 0.0,
                 last_batch_iteration: int = -1) -> None:
        self.optimizer = _torch_optimizer(optimizer)
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        if first <= 0:
            raise ValueError(f"cycle_first_step_size must be positive, got {cycle_first_step_size}")
        if second < 0:
            raise ValueError(f"cycle_second_step_size must be non-negative, got {cycle_second_step_size}")
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (cycle_first_stair_count if cycle_second_stair_count is None
                                   else cycle_second_stair_count)
        self.decay_step_size = decay_step_size
        no_decay_steps = math.isclose(decay_step_size, 0)
        self.min_lrs = _per_group(self.optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(self.optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        self.skip_lr_decay = no_decay_steps or math.isclose(decay_lr_rate, 0)
        self.cycle_momentum = cycle_momentum and "betas" in self.optimizer.defaults
        self.decay_mom_rate = decay_mom_rate
        self.skip_mom_decay = no_decay_steps or math.isclose(decay_mom_rate, 0)
        if self.cycle_momentum:
            self.min_moms = [(m, 0.99) for m in _per_group(self.optimizer, cycle_min_mom, "cycle_min_mom")]
            self.max_moms = [(m, 0.99) for m in _per_group(self.optimizer, cycle_max_mom, "cycle_max_mom")]
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = None
        if last_batch_iteration == -1:
            _write_lrs(self.optimizer, self.min_lrs)
            if self.cycle_momentum:
                for group, betas in zip(self.optimizer.param_groups, self.min_moms):
                    group["betas"] = betas

    def _scale(self) -> float:
        it = self.last_batch_iteration + 1
        cycle = math.floor(1 + it / self.total_size)
        x = 1.0 + it / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            pos = it % self.total_size
            if pos <= self.first_step_size:
                position = pos * stairs / self.first_step_size
            else:
                position = (self.total_size - pos) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return self.min_lrs
        factor = 1 + self.decay_lr_rate * ((self.last_batch_iteration - self.total_size + 1) / self.decay_step_size)
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [(hi[0] - (hi[0] - lo[0]) * scale, lo[1]) for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return self.max_moms
        factor = 1 + self.decay_mom_rate * ((self.last_batch_iteration - self.total_size + 1) / self.decay_step_size)
        return [(b0 * factor, b1) for b0, b1 in self.max_moms]

    def step(self, last_batch_iteration: int | None = None) -> None:
        super().step(last_batch_iteration)
        if self.cycle_momentum:
            for group, betas in zip(self.optimizer.param_groups, self.get_mom()):
                group["betas"] = betas


SCHEDULES: dict[str, type[_Schedule]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
    "LRRangeTest": LRRangeTest,
    "OneCycle": OneCycle,
}
