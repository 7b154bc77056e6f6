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
averages gradients across ranks at sync steps (megatrain/engine/parallel/distributed.py). This package holds
only what every backend shares; the backend-specific work sits behind `megatrain.backend.Backend`
(MegaTrain's engine, the same one the DeepSpeed face holds; the comparison stacks in `baselines/`), whose
class attributes say what each can do.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from ..backend import Backend
from ..config.resolve import resolve
from ..config.schema import EngineConfig
from ..engine import launch_env
from ..run import train_state
from ..run.project import latest_dir, make_project_config, save_dir, state_dir
from .backends import BACKENDS, backend_class
from .data import PreparedDataLoader, skipping
from .tracking import make_trackers
from .wrappers import AcceleratedOptimizer, AcceleratedScheduler, GradientState


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
        kind = backend_class(backend)
        self._launch = launch_env()
        if self._launch.world_size > 1 and not kind.data_parallel:
            # It has no gradient averaging: N ranks would train N unrelated models and report one.
            raise ValueError(f"backend='torch' runs one process; this launch has WORLD_SIZE="
                             f"{self._launch.world_size}. Use backend='megatrain' or 'zero3' for data parallel")
        if isinstance(config, dict):
            for section in ("optimizer", "scheduler"):
                if section in config:
                    raise ValueError(
                        f"the config has a {section!r} section; with the Accelerator, build the {section} in the "
                        "script and pass it to prepare() (megatrain.initialize builds them from a config)"
                    )
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
        # The config and the arguments, settled once (megatrain/config/resolve.py); an EngineConfig describes
        # MegaTrain's engine only, so a backend that reads none gets no engine settings parsed for it.
        reads_engine = kind.reads_engine_config
        settings = resolve(config, mixed_precision=mixed_precision, gradient_accumulation_steps=gradient_accumulation_steps,
                           cpu=cpu, engine=reads_engine)
        self.settings = settings
        self.mixed_precision = settings.mixed_precision
        steps = settings.gradient_accumulation_steps
        self.gradient_state = GradientState(steps, adjust_scheduler, sync_with_dataloader)
        self.cpu = bool(cpu)
        self.project_configuration = make_project_config(project_dir, project_config)
        self.log_with = log_with
        self.trackers: list[Any] = []
        self._custom_objects: list[Any] = []
        self.gradient_checkpointing = bool(gradient_checkpointing)
        # The other stacks read a DeepSpeed-style dict themselves (the ZeRO-3 backend runs it as DeepSpeed's).
        backend_config = settings.engine if reads_engine else config if isinstance(config, dict) else None
        # cpu=True: the engine's device is the CPU whatever accelerator the machine has (each backend says how).
        self.backend: Backend = kind(
            config=backend_config,
            gradient_accumulation_steps=steps,
            mixed_precision=self.mixed_precision,
            gradient_checkpointing=self.gradient_checkpointing,
            gradient_clipping=settings.gradient_clipping,
            cpu=self.cpu,
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
        if self.backend.partitions_params:
            return "DEEPSPEED"  # ZeRO-3 runs on DeepSpeed
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
        if self.backend.fixed_accumulation_steps and steps != self.gradient_state.num_steps:
            raise RuntimeError(f"backend {self.backend.name!r}: DeepSpeed fixes the accumulation steps in its config; pass "
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
        if self.mixed_precision == "bf16" and self.backend.needs_autocast:
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
        if self._models and model is not None and not self.backend.trains_many_models:
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
            self._say_what_runs()
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

    def _say_what_runs(self) -> None:
        """The run's start line, when the model just prepared is on MegaTrain's engine."""
        engine = getattr(self.backend, "engine", None)
        if not getattr(self.backend, "says_what_runs", False) or engine is None:
            return
        from ..run import start_line

        off = ["gradient_checkpointing=True (the engine recomputes each streamed layer itself)"] \
            if self.gradient_checkpointing else []
        off += list(getattr(self.backend, "turned_off", []))  # what preparing the model turned off (prepare_model)
        start_line.announce(start_line.describe("Accelerate (megatrain.Accelerator)", engine, engine.optimizer, off,
                                                getattr(self.backend, "replaced_optimizer", None)), engine)

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
        if not self.backend.supports_clip_value:
            raise RuntimeError(f"backend {self.backend.name!r}: DeepSpeed does not support clip_grad_value_ (as in "
                               "accelerate); use clip_grad_norm_")
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
            return PreparedDataLoader(skipping(dataloader.loader, num_batches * self.num_processes), self.device,
                                      self.gradient_state, self.num_processes, self.process_index)
        if isinstance(dataloader, torch.utils.data.DataLoader):
            return skipping(dataloader, num_batches)
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
        face = {"backend": self.backend.name, "step": self.gradient_state.step, "schedulers": len(self._schedulers),
                "gradient_accumulation_steps": self.gradient_accumulation_steps}
        train_state.write_face_state(d, schedulers=self._schedulers, customs=self._custom_objects,
                                     sampler_states=[dl.epoch_rng_state for dl in self._dataloaders], face=face)
        self.project_configuration.iteration += 1
        self._saved()
        return str(d)

    def _replicated_writer_only(self, share: Callable[[], None] | None = None) -> bool:
        """megatrain data parallel: every rank sees the same weights and (gathered) optimizer state, so the main
        process writes them for all (the state then loads on any number of ranks) and the others wait, after
        running `share` (their part of a collective the main process's write runs)."""
        if self.backend.main_process_writes and not self.is_main_process:
            if share is not None:
                share()
            self.wait_for_everyone()
            return True
        return False

    def _saved(self) -> None:
        if self.backend.main_process_writes and self.num_processes > 1:
            self.wait_for_everyone()

    def load_state(self, input_dir: str | os.PathLike | None = None) -> None:
        """Restore a save_state folder (the newest automatically named one when `input_dir` is None)."""
        d = latest_dir(input_dir, self.project_configuration)
        face = train_state.read_face(d)
        if face["backend"] != self.backend.name:
            raise ValueError(f"{d} was saved by backend {face['backend']!r}, not {self.backend.name!r}")
        if face["schedulers"] != len(self._schedulers):
            raise ValueError(f"{d} holds {face['schedulers']} scheduler states but {len(self._schedulers)} are prepared")
        customs = train_state.count_customs(d)
        if customs != len(self._custom_objects):
            raise RuntimeError(f"{d} holds {customs} custom checkpoints but {len(self._custom_objects)} objects are "
                               "registered for checkpointing; register the same objects that were saved")
        self.backend.load_state(d)
        train_state.load_face_state(d, schedulers=self._schedulers, customs=self._custom_objects)
        states = train_state.read_sampler_states(d)
        if states is not None:
            if len(states) != len(self._dataloaders):
                raise RuntimeError(f"{d} holds the sampler states of {len(states)} dataloaders but "
                                   f"{len(self._dataloaders)} are prepared; prepare the same dataloaders")
            for dl, state in zip(self._dataloaders, states):
                dl.set_epoch_rng_state(state)
        self.gradient_state.step = int(face["step"])
