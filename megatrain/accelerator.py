"""The Accelerate-style face: one training script, three interchangeable backends.

    accelerator = Accelerator(backend="megatrain" | "zero3" | "torch", gradient_accumulation_steps=2)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()

Names and behaviour follow `accelerate.Accelerator`: `backward` divides by the accumulation steps,
the prepared optimizer steps and zeroes only at sync steps, the prepared scheduler steps only when
the optimizer did. Launched as several ranks (`torchrun`, `accelerate launch`), each process gets
every N-th batch of a prepared dataloader (Accelerate's default sharding) and the megatrain backend
averages gradients across ranks at sync steps (megatrain/engine/distributed.py). This module holds only what every backend shares; the
backend-specific work sits behind `megatrain.backend.Backend` (MegaTrain's engine here, the
comparison stacks in `baselines/`).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import os
import random
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from .backend import Backend, MegatrainBackend
from .config import EngineConfig
from .engine.distributed import launch_env
from .project import latest_dir, make_project_config, save_dir, state_dir
from .tracking import make_trackers

BACKENDS = ("megatrain", "zero3", "zero3-alst", "torch")
_MIXED_PRECISION = ("no", "bf16")
_FACE_FILE = "accelerator.json"
# accelerate's own file names in a save_state folder (accelerate.utils.constants)
_RNG_FILE = "random_states_0.pkl"
_SAMPLER_FILE = "sampler.bin"


def _scheduler_file(i: int) -> str:
    return "scheduler.bin" if i == 0 else f"scheduler_{i}.bin"


def _custom_file(i: int) -> str:
    return f"custom_checkpoint_{i}.pkl"


def _resolve_mixed_precision(mixed_precision: str, config: Any) -> str:
    if mixed_precision not in _MIXED_PRECISION:
        raise ValueError(f"mixed_precision={mixed_precision!r} is not supported; use one of {_MIXED_PRECISION}")
    if isinstance(config, EngineConfig):
        from_config: bool | None = config.compute_dtype == "bfloat16"
    elif isinstance(config, dict):
        section = config.get("bf16", config.get("bfloat16", {})) or {}
        on = section.get("enabled", "auto")
        from_config = None if on == "auto" else bool(on)
    else:
        from_config = None
    if from_config is None:
        return mixed_precision
    if from_config and mixed_precision == "no":
        return "bf16"  # the config asked for it and the argument was left at its default
    if not from_config and mixed_precision == "bf16":
        raise ValueError("mixed_precision='bf16' contradicts the config, which disables bf16")
    return mixed_precision


def _resolve_gradient_clipping(config: Any) -> float:
    """The per-step clipping a config asks for, with DeepSpeed's meaning (absent -> 1.0)."""
    if not isinstance(config, dict):
        return 0.0  # no DeepSpeed config: clip only where the script calls clip_grad_norm_
    clip = config.get("gradient_clipping", 1.0)
    if clip == "auto" or clip is None:
        return 0.0  # Accelerate fills "auto" from the script, i.e. from clip_grad_norm_ calls
    clip = float(clip)
    if clip < 0:
        raise ValueError(f"gradient_clipping={clip} must be >= 0")
    return clip


def _resolve_accumulation(steps: int, config: Any) -> int:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"gradient_accumulation_steps={steps!r} must be an int >= 1")
    if isinstance(config, dict):
        from_config = config.get("gradient_accumulation_steps", "auto")
        if from_config != "auto":
            if steps == 1:
                return int(from_config)  # the argument was left at its default
            if int(from_config) != steps:
                raise ValueError(
                    f"gradient_accumulation_steps={steps} contradicts the config's {from_config}; set one of them"
                )
    return steps


def _forward_attr(wrapper: Any, inner: str, name: str) -> Any:
    # Only reached for names the wrapper lacks; the guard keeps copy/pickle (no __dict__ yet) from recursing.
    target = wrapper.__dict__.get(inner)
    if target is None:
        raise AttributeError(name)
    return getattr(target, name)


class GradientState:
    """When gradients are synchronised, i.e. when the optimizer really steps (Accelerate's rule)."""

    def __init__(self, num_steps: int, adjust_scheduler: bool = True, sync_with_dataloader: bool = True) -> None:
        self.num_steps = num_steps
        self.adjust_scheduler = adjust_scheduler
        self.sync_with_dataloader = sync_with_dataloader
        self.step = 0
        self.sync_gradients = True
        self.end_of_dataloader = False
        self.optimizer_stepped = False

    def advance(self) -> None:
        # The last batch of an epoch syncs (unless the plugin says otherwise), so a short epoch loses no gradients.
        if self.end_of_dataloader and self.sync_with_dataloader:
            self.step = 0
            self.sync_gradients = True
        else:
            self.step += 1
            self.sync_gradients = self.step % self.num_steps == 0


class AcceleratedOptimizer:
    """The user's view of the optimizer: `step()` and `zero_grad()` act only at sync steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, backend: Backend, state: GradientState) -> None:
        self.optimizer = optimizer
        self._backend = backend
        self._state = state
        self._skipped = False

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("optimizer.step(closure) is not supported through the Accelerator")
        self._state.optimizer_stepped = False
        if not self._state.sync_gradients:
            return
        self._backend.optimizer_step()
        self._skipped = self._backend.step_was_skipped()
        self._state.optimizer_stepped = not self._skipped

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        if self._state.sync_gradients:
            self._backend.zero_grad(set_to_none=True if set_to_none is None else set_to_none)

    @property
    def step_was_skipped(self) -> bool:
        return self._skipped

    def state_dict(self) -> dict[str, Any]:
        self._synchronize()
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._synchronize()
        self.optimizer.load_state_dict(state)

    def _synchronize(self) -> None:
        # megatrain with optimizer_overlap may still be updating layers on a host thread
        sync = getattr(self._backend, "synchronize", None)
        if sync is not None:
            sync()

    def __getattr__(self, name: str) -> Any:
        return _forward_attr(self, "optimizer", name)

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"


class AcceleratedScheduler:
    """The user's LR scheduler, stepped only when the optimizer really stepped (Accelerate's rule)."""

    def __init__(self, scheduler: Any, optimizers: list[AcceleratedOptimizer], state: GradientState) -> None:
        self.scheduler = scheduler
        self._optimizers = optimizers
        self._state = state

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self._state.sync_gradients:
            # Accelerate keeps torch's "scheduler stepped before optimizer" bookkeeping consistent.
            if self._state.adjust_scheduler and hasattr(self.scheduler, "_step_count"):
                self.scheduler._step_count += 1
            return
        if any(o.step_was_skipped for o in self._optimizers):
            return
        opt = getattr(self.scheduler, "optimizer", None)
        if opt is not None:
            # The backend stepped on the optimizer's behalf, so torch's check that the optimizer was
            # stepped first would warn spuriously.
            opt._opt_called = True
        self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        return _forward_attr(self, "scheduler", name)


def _to_device(obj: Any, device: torch.device) -> Any:
    if torch.is_tensor(obj):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, dict):
        return type(obj)({k: _to_device(v, device) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj


class _Skip:
    """A batch sampler (its skipped batches are never loaded) or an iterable-dataset loader (they must be
    produced to be passed over) without its first `skip` batches."""

    def __init__(self, inner: Any, skip: int) -> None:
        self.inner = inner
        self.skip = skip

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.inner), self.skip, None)

    def __len__(self) -> int:
        return max(len(self.inner) - self.skip, 0)


def _skipping(loader: torch.utils.data.DataLoader, skip: int) -> Any:
    if skip == 0:
        return loader
    if isinstance(loader.dataset, torch.utils.data.IterableDataset) or loader.batch_sampler is None:
        return _Skip(loader, skip)
    return torch.utils.data.DataLoader(
        loader.dataset, batch_sampler=_Skip(loader.batch_sampler, skip), collate_fn=loader.collate_fn,
        num_workers=loader.num_workers, pin_memory=loader.pin_memory, timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn, multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator, persistent_workers=loader.persistent_workers)


class PreparedDataLoader:
    """Yields the loader's batches on the backend's device and marks the last one of each epoch.

    With several ranks, rank r of N yields batches r, r + N, r + 2N, ... (Accelerate's default
    sharding): one round of N batches is one global batch of N x the loader's batch size. A last,
    incomplete round is dropped (every rank must take the same number of steps).
    """

    def __init__(self, loader: torch.utils.data.DataLoader, device: torch.device, state: GradientState,
                 num_processes: int = 1, process_index: int = 0) -> None:
        self.loader = loader
        self._device = device
        self._state = state
        self._n = num_processes
        self._rank = process_index
        if num_processes > 1:
            try:
                extra = len(loader) % num_processes
            except TypeError:
                extra = 0  # an iterable dataset without a length: its rounds are counted as they come
            if extra:
                warnings.warn(f"the dataloader's {len(loader)} batches do not split evenly over {num_processes} "
                              f"processes: the last {extra} are dropped every epoch", stacklevel=3)
        self.epoch_rng_state: torch.Tensor | None = None

    def _generator(self) -> torch.Generator | None:
        loader = self.loader.inner if isinstance(self.loader, _Skip) else self.loader
        batches = getattr(loader, "batch_sampler", None)
        sampler = getattr(batches.inner if isinstance(batches, _Skip) else batches, "sampler", None)
        gen = getattr(sampler, "generator", None)
        return gen if gen is not None else getattr(loader, "generator", None)

    def set_epoch_rng_state(self, state: torch.Tensor | None) -> None:
        """Rewind the sampler's generator to where an epoch began, so that epoch's order comes again."""
        gen = self._generator()
        if state is not None and gen is not None:
            gen.set_state(state)

    def _mine(self) -> Iterator[Any]:
        if self._n == 1:
            yield from self.loader
            return
        round_: list[Any] = []
        for batch in self.loader:
            round_.append(batch)
            if len(round_) == self._n:
                yield round_[self._rank]
                round_ = []

    def __iter__(self) -> Iterator[Any]:
        self._state.end_of_dataloader = False
        gen = self._generator()
        # The order of this epoch is drawn from the generator when iteration starts: remember where it stood, so a
        # checkpoint taken mid-epoch resumes the same order (save_state / load_state, then skip_first_batches).
        self.epoch_rng_state = gen.get_state() if gen is not None else None
        it = self._mine()
        try:
            current = next(it)
        except StopIteration:
            return
        while True:
            # Look one batch ahead so the last batch is known to be last while it is being used.
            try:
                upcoming = next(it)
            except StopIteration:
                self._state.end_of_dataloader = True
                yield _to_device(current, self._device)
                break
            yield _to_device(current, self._device)
            current = upcoming
        self._state.end_of_dataloader = False

    def __len__(self) -> int:
        return len(self.loader) // self._n

    def __getattr__(self, name: str) -> Any:
        return _forward_attr(self, "loader", name)


def _force_cpu(backend: str, config: Any) -> Any:
    """`cpu=True`: the engine's device is the CPU whatever accelerator the machine has."""
    if backend == "zero3":
        if torch.cuda.is_available():
            raise ValueError("cpu=True with backend 'zero3': DeepSpeed picks its accelerator itself; run with "
                             "DS_ACCELERATOR=cpu and CUDA_VISIBLE_DEVICES='' instead")
        return config
    if backend != "megatrain":
        return config
    if isinstance(config, EngineConfig):
        if config.device not in (None, "cpu"):
            raise ValueError(f"cpu=True contradicts the EngineConfig's device={config.device!r}; drop one of them")
        return EngineConfig.from_dict({**config.to_dict(), "device": "cpu"})
    config = dict(config or {})
    section = dict(config.get("megatrain") or {})
    if section.get("device") not in (None, "cpu"):
        raise ValueError(f"cpu=True contradicts the config's megatrain.device={section['device']!r}; drop one of them")
    config["megatrain"] = {**section, "device": "cpu"}
    return config


def _make_backend(name: str, **kwargs: Any) -> Backend:
    if name == "megatrain":
        return MegatrainBackend(**kwargs)
    if name == "torch":
        from baselines.torch_backend import TorchBackend

        return TorchBackend(**kwargs)
    if name == "zero3":
        from baselines.zero3 import Zero3Backend

        return Zero3Backend(**kwargs)
    if name == "zero3-alst":
        from baselines.alst import Zero3AlstBackend

        return Zero3AlstBackend(**kwargs)
    raise ValueError(f"backend={name!r} is not one of {BACKENDS}")


class _DeviceAccelerator:
    """What `deepspeed.accelerator.get_accelerator()` answers, for the device MegaTrain computes on."""

    def __init__(self) -> None:
        self._device = torch.accelerator.current_accelerator() or torch.device("cpu")

    def device_name(self, device_index: int | None = None) -> str:
        if device_index is None or self._device.type == "cpu":
            return self._device.type
        return f"{self._device.type}:{device_index}"

    def current_device_name(self) -> str:
        if self._device.type == "cpu":
            return "cpu"
        return f"{self._device.type}:{torch.get_device_module(self._device).current_device()}"

    def current_device(self) -> int:
        return 0 if self._device.type == "cpu" else torch.get_device_module(self._device).current_device()

    def device_count(self) -> int:
        return 1 if self._device.type == "cpu" else torch.get_device_module(self._device).device_count()

    def is_available(self) -> bool:
        return True

    def communication_backend_name(self) -> str:
        return "nccl" if self._device.type == "cuda" else "gloo"

    def synchronize(self, device_index: int | None = None) -> None:
        if self._device.type != "cpu":
            torch.get_device_module(self._device).synchronize()

    def empty_cache(self) -> None:
        if self._device.type != "cpu":
            torch.get_device_module(self._device).empty_cache()

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return False  # MegaTrain computes in FP32 or bf16


def get_accelerator() -> _DeviceAccelerator:
    """`deepspeed.accelerator.get_accelerator()` under `import megatrain as deepspeed`."""
    return _DeviceAccelerator()


class Accelerator:
    """`accelerate.Accelerator`'s interface over MegaTrain, DeepSpeed ZeRO-3 offload or plain PyTorch.

    `config`: a DeepSpeed-style dict (its `megatrain` section configures the engine; the ZeRO-3
    backend runs it as its DeepSpeed config), an `EngineConfig`, or None. Settings the config and
    the arguments both give must agree; a `gradient_clipping` in a dict config clips every step
    (DeepSpeed's meaning, default 1.0) unless the script calls `clip_grad_norm_` itself.
    `gradient_checkpointing=True` turns on Hugging Face's per-layer checkpointing on the torch and
    ZeRO-3 backends; MegaTrain always recomputes per layer, so all three then do the same FLOPs.
    """

    def __init__(
        self,
        backend: str = "megatrain",
        config: dict[str, Any] | EngineConfig | None = None,
        gradient_accumulation_steps: int = 1,
        mixed_precision: str = "no",
        gradient_checkpointing: bool = False,
        cpu: bool = False,
        project_dir: str | os.PathLike | None = None,
        project_config: Any = None,
        log_with: Any = None,
        gradient_accumulation_plugin: Any = None,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
        self._launch = launch_env()
        if self._launch.world_size > 1 and backend == "torch":
            # It has no gradient averaging: N ranks would train N unrelated models and report one.
            raise ValueError(f"backend='torch' runs one process; this launch has WORLD_SIZE="
                             f"{self._launch.world_size}. Use backend='megatrain' or 'zero3' for data parallel")
        if config is not None and not isinstance(config, (dict, EngineConfig)):
            raise TypeError(f"config must be a DeepSpeed-style dict, an EngineConfig or None, not {type(config).__name__}")
        if isinstance(config, dict):
            for section in ("optimizer", "scheduler"):
                if section in config:
                    raise ValueError(
                        f"the config has a {section!r} section; with the Accelerator, build the {section} in the "
                        "script and pass it to prepare() (megatrain.initialize builds them from a config)"
                    )
        self.mixed_precision = _resolve_mixed_precision(mixed_precision, config)
        adjust_scheduler, sync_with_dataloader = True, True
        if gradient_accumulation_plugin is not None:
            from accelerate.utils import GradientAccumulationPlugin

            if not isinstance(gradient_accumulation_plugin, GradientAccumulationPlugin):
                raise TypeError("gradient_accumulation_plugin must be an accelerate.utils.GradientAccumulationPlugin, "
                                f"got {type(gradient_accumulation_plugin).__name__}")
            if gradient_accumulation_steps != 1:
                raise ValueError("give gradient_accumulation_steps or gradient_accumulation_plugin, not both "
                                 "(as accelerate requires)")
            gradient_accumulation_steps = gradient_accumulation_plugin.num_steps
            adjust_scheduler = gradient_accumulation_plugin.adjust_scheduler
            sync_with_dataloader = gradient_accumulation_plugin.sync_with_dataloader
        steps = _resolve_accumulation(gradient_accumulation_steps, config)
        self.gradient_state = GradientState(steps, adjust_scheduler, sync_with_dataloader)
        self.cpu = bool(cpu)
        if self.cpu:
            config = _force_cpu(backend, config)
        self.project_configuration = make_project_config(project_dir, project_config)
        self.log_with = log_with
        self.trackers: list[Any] = []
        self._custom_objects: list[Any] = []
        self.gradient_checkpointing = bool(gradient_checkpointing)
        # An EngineConfig describes MegaTrain's engine only; the other stacks have nothing to read in it.
        backend_config = config if backend == "megatrain" or isinstance(config, dict) else None
        extra = {"device": "cpu"} if self.cpu and backend == "torch" else {}
        self.backend: Backend = _make_backend(
            backend,
            config=backend_config,
            gradient_accumulation_steps=steps,
            mixed_precision=self.mixed_precision,
            gradient_checkpointing=self.gradient_checkpointing,
            gradient_clipping=_resolve_gradient_clipping(config),
            **extra,
        )
        self._models: list[Any] = []
        self._optimizers: list[AcceleratedOptimizer] = []
        self._schedulers: list[AcceleratedScheduler] = []
        self._dataloaders: list[PreparedDataLoader] = []
        self._live_optimizer: dict[int, torch.optim.Optimizer] = {}  # id(user's optimizer) -> the one stepping
        self._micro_batch_size: int | None = None
        self._no_sync = False

    # -- this process's place in the launch (Accelerate's names) ------------------------------------
    @property
    def backend_name(self) -> str:
        return self.backend.name

    @property
    def device(self) -> torch.device:
        return self.backend.device

    @property
    def num_processes(self) -> int:
        return self._launch.world_size

    @property
    def process_index(self) -> int:
        return self._launch.rank

    @property
    def local_process_index(self) -> int:
        return self._launch.local_rank

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def distributed_type(self) -> str:
        if self.backend.name in ("zero3", "zero3-alst"):
            return "DEEPSPEED"
        return "MULTI_GPU" if self.num_processes > 1 and self.device.type == "cuda" else (
            "MULTI_CPU" if self.num_processes > 1 else "NO")

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        # The main process runs the block first (downloads, preprocessing caches), the others after it.
        if not self.is_main_process:
            self.wait_for_everyone()
        yield
        if self.is_main_process:
            self.wait_for_everyone()

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        if not self.is_local_main_process:
            self.wait_for_everyone()
        yield
        if self.is_local_main_process:
            self.wait_for_everyone()

    @property
    def project_dir(self) -> str | None:
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | None:
        return self.project_configuration.logging_dir

    @property
    def save_iteration(self) -> int:
        return self.project_configuration.iteration

    def wait_for_everyone(self) -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self.is_local_main_process:
            print(*args, **kwargs)

    # -- gradient accumulation -----------------------------------------------------------------------
    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"gradient_accumulation_steps={steps!r} must be an int >= 1")
        if self.backend.name == "zero3" and steps != self.gradient_state.num_steps:
            raise RuntimeError("backend 'zero3': DeepSpeed fixes the accumulation steps in its config; pass "
                               "gradient_accumulation_steps to the Accelerator instead")
        self.gradient_state.num_steps = steps

    @property
    def sync_gradients(self) -> bool:
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.gradient_state.sync_gradients = bool(value)

    @property
    def optimizer_step_was_skipped(self) -> bool:
        return any(o.step_was_skipped for o in self._optimizers)

    @contextlib.contextmanager
    def accumulate(self, *models: Any) -> Iterator[None]:
        """Count one micro-batch; inside, `sync_gradients` says whether the optimizer will step."""
        self.gradient_state.advance()
        yield

    @contextlib.contextmanager
    def no_sync(self, model: Any = None) -> Iterator[None]:
        """Backwards inside keep their gradients local; they are averaged at the next sync step."""
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        if self.mixed_precision == "bf16" and self.backend.name == "torch":
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                yield
        else:
            yield  # the other backends cast inside their own forward

    # -- prepare ---------------------------------------------------------------------------------------
    def prepare(self, *objs: Any) -> Any:
        """Wrap models, optimizers, dataloaders and schedulers (any subset, any order) for the backend.

        Returns them in the order given (a single object when one was given). A model and the
        optimizer built over its parameters go in the same call for the megatrain and zero3
        backends: both take the optimizer over while they take the model.
        """
        models = [o for o in objs if isinstance(o, torch.nn.Module)]
        optimizers = [o for o in objs if isinstance(o, torch.optim.Optimizer)]
        if len(models) > 1 or len(optimizers) > 1:
            raise ValueError("prepare() takes at most one model and one optimizer per call")
        for o in objs:
            if isinstance(o, torch.utils.data.DataLoader) and isinstance(o.batch_size, int):
                self._micro_batch_size = self._micro_batch_size or o.batch_size
        model = models[0] if models else None
        optimizer = optimizers[0] if optimizers else None
        if self._models and model is not None and self.backend.name != "torch":
            raise RuntimeError(f"backend {self.backend.name!r} trains one model per Accelerator")

        prepared_model, live_opt = None, None
        if model is not None or optimizer is not None:
            prepared_model, live_opt = self.backend.prepare(model, optimizer, micro_batch_size=self._micro_batch_size)
        wrapped_opt = None
        if optimizer is not None:
            # Before the loop: a scheduler listed ahead of its optimizer must still find it.
            if live_opt is None:
                raise RuntimeError(f"backend {self.backend.name!r} returned no optimizer for the one passed")
            self._live_optimizer[id(optimizer)] = live_opt
            wrapped_opt = AcceleratedOptimizer(live_opt, self.backend, self.gradient_state)
            self._optimizers.append(wrapped_opt)
        if model is not None:
            self._models.append(prepared_model)
        out: list[Any] = []
        for o in objs:
            if model is not None and o is model:
                out.append(prepared_model)
            elif optimizer is not None and o is optimizer:
                out.append(wrapped_opt)
            elif isinstance(o, torch.utils.data.DataLoader):
                dl = PreparedDataLoader(o, self.device, self.gradient_state, self.num_processes, self.process_index)
                self._dataloaders.append(dl)
                out.append(dl)
            elif isinstance(o, (LRScheduler, ReduceLROnPlateau)):
                out.append(self._prepare_scheduler(o))
            else:
                out.append(o)  # Accelerate passes objects it does not know through untouched
        return out[0] if len(out) == 1 else tuple(out)

    def _prepare_scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        opt = scheduler.optimizer
        live = self._live_optimizer.get(id(opt))
        if live is None and not any(o.optimizer is opt for o in self._optimizers):
            raise ValueError(
                "prepare the optimizer this scheduler drives before (or together with) the scheduler"
            )
        if live is not None and live is not opt:
            # A backend replaced the optimizer (ZeRO-3 swaps in DeepSpeedCPUAdam). It shares the
            # user's param-group dicts, so the schedule reaches it; check rather than assume.
            if not all(a is b for a, b in zip(opt.param_groups, live.param_groups)):
                scheduler.optimizer = live
        wrapped = AcceleratedScheduler(scheduler, self._optimizers, self.gradient_state)
        self._schedulers.append(wrapped)
        return wrapped

    # -- the training step ----------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backpropagate `loss / gradient_accumulation_steps` (Accelerate's scaling)."""
        if kwargs:
            raise TypeError(f"backward() got unsupported arguments {sorted(kwargs)}")
        self.backend.backward(loss / self.gradient_accumulation_steps, sync=self.sync_gradients and not self._no_sync)

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor | None:
        """Clip the accumulated gradients to a global norm of `max_norm`; return the norm before."""
        norm = self.backend.clip_grad_norm_(parameters, max_norm, norm_type)
        return None if norm is None else torch.tensor(norm)

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor] | torch.Tensor, clip_value: float) -> None:
        """Clamp every accumulated gradient to [-clip_value, clip_value] (torch.nn.utils.clip_grad_value_)."""
        if self.backend.name == "zero3":
            raise RuntimeError("backend 'zero3': DeepSpeed does not support clip_grad_value_ (as in accelerate); "
                               "use clip_grad_norm_")
        by_backend = getattr(self.backend, "clip_grad_value_", None)
        if by_backend is not None:
            by_backend(float(clip_value))
        else:
            torch.nn.utils.clip_grad_value_(parameters, clip_value)

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """A loader like `dataloader` without its first `num_batches` batches (resuming mid-epoch)."""
        if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 0:
            raise ValueError(f"num_batches={num_batches!r} must be an int >= 0")
        if isinstance(dataloader, PreparedDataLoader):
            # num_batches counts this process's batches; with N processes each is one of a round of N.
            return PreparedDataLoader(_skipping(dataloader.loader, num_batches * self.num_processes), self.device,
                                      self.gradient_state, self.num_processes, self.process_index)
        if isinstance(dataloader, torch.utils.data.DataLoader):
            return _skipping(dataloader, num_batches)
        raise TypeError(f"skip_first_batches takes a DataLoader, got {type(dataloader).__name__}")

    # -- tracking ------------------------------------------------------------------------------------------
    def init_trackers(self, project_name: str, config: dict[str, Any] | None = None,
                      init_kwargs: dict[str, dict[str, Any]] | None = None) -> None:
        """Start the trackers named in `log_with` (accelerate's tracker classes) and store `config` in them."""
        self.trackers = make_trackers(self.log_with, project_name, self.logging_dir, config, init_kwargs)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        raise ValueError(f"no tracker named {name!r} was started (started: {[t.name for t in self.trackers]})")

    def log(self, values: dict[str, Any], step: int | None = None, log_kwargs: dict[str, dict] | None = None) -> None:
        log_kwargs = log_kwargs or {}
        for tracker in self.trackers:
            tracker.log(values, step=step, **log_kwargs.get(tracker.name, {}))

    def end_training(self) -> None:
        """Finish every tracker (accelerate's end of a run)."""
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []

    # -- memory -----------------------------------------------------------------------------------------------
    def free_memory(self, *objects: Any) -> list[None]:
        """Drop every reference this Accelerator holds (model, engine, optimizers, schedulers, loaders) and collect
        garbage; returns one None per object passed, for `model, opt = accelerator.free_memory(model, opt)`."""
        release = getattr(self.backend, "release", None)
        if release is not None:
            release()
        self._models, self._optimizers, self._schedulers, self._dataloaders = [], [], [], []
        self._live_optimizer = {}
        self._micro_batch_size = None
        self.gradient_state.step = 0
        objects = [None] * len(objects)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return objects

    clear = free_memory

    def unwrap_model(self, model: Any, keep_fp32_wrapper: bool = True) -> Any:
        """The user's model class (for MegaTrain the same object `prepare` returned)."""
        return self.backend.unwrap_model(model)

    def get_state_dict(self, model: Any, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """Every weight of `model` by its HF name, gathered whole whatever the backend (Accelerate's name)."""
        return self.backend.get_state_dict(model)

    def _collective(self) -> bool:
        if self.num_processes == 1:
            return False
        if not torch.distributed.is_initialized():
            raise RuntimeError("gather/reduce across processes need the process group: prepare() the model first")
        return True

    def gather(self, tensor: Any) -> Any:
        """Every process's tensor concatenated along dim 0 (a 0-d tensor counts as one row), in rank order."""
        if not torch.is_tensor(tensor) or not self._collective():
            return tensor
        t = tensor.reshape(1) if tensor.dim() == 0 else tensor.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.num_processes)]
        torch.distributed.all_gather(parts, t)
        return torch.cat(parts)

    def gather_for_metrics(self, tensor: Any) -> Any:
        return self.gather(tensor)

    def reduce(self, tensor: Any, reduction: str = "sum") -> Any:
        """The sum (or, with reduction="mean", the mean) of `tensor` over the processes."""
        if reduction not in ("sum", "mean"):
            raise ValueError(f"reduction={reduction!r} must be 'sum' or 'mean'")
        if not torch.is_tensor(tensor) or not self._collective():
            return tensor
        out = tensor.clone()
        torch.distributed.all_reduce(out)
        return out / self.num_processes if reduction == "mean" else out

    # -- saving ------------------------------------------------------------------------------------------
    def save(self, obj: Any, f: str | os.PathLike, safe_serialization: bool = False) -> None:
        """Save `obj` to `f` (torch.save, or safetensors for a dict of tensors with safe_serialization)."""
        if safe_serialization:
            from safetensors.torch import save_file

            save_file(obj, str(f), metadata={"format": "pt"})
        else:
            torch.save(obj, f)

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Objects with state_dict()/load_state_dict() to save and load with save_state/load_state."""
        bad = [type(o).__name__ for o in objects if not (hasattr(o, "state_dict") and hasattr(o, "load_state_dict"))]
        if bad:
            raise ValueError(f"register_for_checkpointing: {bad} have no state_dict()/load_state_dict(); only such "
                             "objects can be checkpointed")
        self._custom_objects.extend(objects)

    def save_model(self, model: Any, save_directory: str | os.PathLike) -> None:
        """Write a Hugging Face checkpoint that `AutoModelForCausalLM.from_pretrained` loads."""
        if self._replicated_writer_only():
            return
        Path(save_directory).mkdir(parents=True, exist_ok=True)
        self.backend.save_model(model, save_directory)
        self._saved()

    def save_state(self, output_dir: str | os.PathLike | None = None) -> str:
        """Everything needed to resume: weights, optimizer, schedulers, RNG, accumulation position, registered objects.

        Without `output_dir`, under `ProjectConfiguration(automatic_checkpoint_naming=True)`, the folder is
        `<project_dir>/checkpoints/checkpoint_<iteration>` and old ones beyond `total_limit` are deleted.
        Returns the folder written.
        """
        # Every rank names the folder (and refuses a call without one) before any rank waits for another: the
        # others return the folder the main process writes, as accelerate's save_state does on every rank. A
        # shared host store's optimizer state is sharded: every rank adds its share to the main process's save.
        name = state_dir(output_dir, self.project_configuration)
        if self._replicated_writer_only(lambda: self.backend.save_state(None)):
            self.project_configuration.iteration += 1
            return str(name)
        d = save_dir(output_dir, self.project_configuration)
        d.mkdir(parents=True, exist_ok=True)
        self.backend.save_state(d)
        for i, s in enumerate(self._schedulers):
            torch.save(s.state_dict(), d / _scheduler_file(i))
        for i, obj in enumerate(self._custom_objects):
            torch.save(obj.state_dict(), d / _custom_file(i))
        torch.save([dl.epoch_rng_state for dl in self._dataloaders], d / _SAMPLER_FILE)
        rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
        try:
            import numpy as np

            rng["numpy"] = np.random.get_state()
        except ImportError:
            pass
        torch.save(rng, d / _RNG_FILE)
        face = {"backend": self.backend.name, "step": self.gradient_state.step, "schedulers": len(self._schedulers),
                "gradient_accumulation_steps": self.gradient_accumulation_steps}
        (d / _FACE_FILE).write_text(json.dumps(face, indent=1))
        self.project_configuration.iteration += 1
        self._saved()
        return str(d)

    def _replicated_writer_only(self, share: Callable[[], None] | None = None) -> bool:
        """megatrain data parallel: every rank sees the same weights and (gathered) optimizer state, so the main
        process writes them for all (the state then loads on any number of ranks) and the others wait, after
        running `share` (their part of a collective the main process's write runs)."""
        if self.backend.name == "megatrain" and not self.is_main_process:
            if share is not None:
                share()
            self.wait_for_everyone()
            return True
        return False

    def _saved(self) -> None:
        if self.backend.name == "megatrain" and self.num_processes > 1:
            self.wait_for_everyone()

    def load_state(self, input_dir: str | os.PathLike | None = None) -> None:
        """Restore a save_state folder (the newest automatically named one when `input_dir` is None)."""
        d = latest_dir(input_dir, self.project_configuration)
        face_path = d / _FACE_FILE
        if not face_path.is_file():
            raise FileNotFoundError(f"{d} holds no Accelerator state ({_FACE_FILE} is missing)")
        face = json.loads(face_path.read_text())
        if face["backend"] != self.backend.name:
            raise ValueError(f"{d} was saved by backend {face['backend']!r}, not {self.backend.name!r}")
        if face["schedulers"] != len(self._schedulers):
            raise ValueError(f"{d} holds {face['schedulers']} scheduler states but {len(self._schedulers)} are prepared")
        customs = sorted(p.name for p in d.glob("custom_checkpoint_*.pkl"))
        if len(customs) != len(self._custom_objects):
            raise RuntimeError(f"{d} holds {len(customs)} custom checkpoints but {len(self._custom_objects)} objects are "
                               "registered for checkpointing; register the same objects that were saved")
        self.backend.load_state(d)
        for i, s in enumerate(self._schedulers):
            s.load_state_dict(torch.load(d / _scheduler_file(i), weights_only=False))
        for i, obj in enumerate(self._custom_objects):
            obj.load_state_dict(torch.load(d / _custom_file(i), weights_only=False))
        if (d / _SAMPLER_FILE).is_file():
            states = torch.load(d / _SAMPLER_FILE, weights_only=True)
            if len(states) != len(self._dataloaders):
                raise RuntimeError(f"{d} holds the sampler states of {len(states)} dataloaders but "
                                   f"{len(self._dataloaders)} are prepared; prepare the same dataloaders")
            for dl, state in zip(self._dataloaders, states):
                dl.set_epoch_rng_state(state)
        # Python's and numpy's RNG states are plain tuples; they need the non-weights unpickler.
        rng = torch.load(d / _RNG_FILE, weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if "numpy" in rng:
            import numpy as np

            np.random.set_state(rng["numpy"])
        self.gradient_state.step = int(face["step"])
