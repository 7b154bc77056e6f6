"""`megatrain.Accelerator`: accelerate's own `Accelerator` with MegaTrain (or a comparison stack) as the engine.

    from megatrain import Accelerator                       # instead of `from accelerate import Accelerator`
    accelerator = Accelerator(backend="megatrain")          # "megatrain" | "zero3" | "zero3-alst" | "torch"

It is a subclass of `accelerate.Accelerator`: the state (`AcceleratorState`, `PartialState`, so accelerate's
`get_logger` works), data-loader sharding, seeding and RNG synchronisation, `split_batches` / `even_batches`,
gradient accumulation (`accumulate`, `GradientState`), accelerate's `AcceleratedScheduler` (stepped once per
process per optimizer step, as accelerate does), trackers, `gather` / `reduce` / `pad_across_processes`, the
checkpoint layout of `save_state` / `load_state` (schedulers, samplers, RNG, registered objects, hooks) are
accelerate's own code. What it replaces is the model and optimizer engine, behind `megatrain.backend.Backend`:
`prepare_model` / `prepare_optimizer` hand the model and its optimizer to the backend (together when `prepare` is
given both), `backward`, `clip_grad_norm_` / `clip_grad_value_` and the prepared optimizer's `step` go to it, and
the weights and optimizer state in a `save_state` folder are written by it (accelerate's file names). The
backend's class attributes say what each can do; what cannot apply is refused by name (refusals.py).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import accelerate
import torch
from accelerate.utils import GradientAccumulationPlugin, parse_choice_from_env, parse_flag_from_env

from ..backend import Backend
from ..config.resolve import resolve
from ..config.schema import EngineConfig
from ..engine import launch_env
from ..run.project import state_dir
from .backends import BACKENDS, backend_class
from .refusals import check_arguments, refused
from .wrappers import AcceleratedOptimizer

# Which backend wrote a save_state folder (beside accelerate's files): another backend's weights are refused.
FACE_FILE = "megatrain_accelerator.json"


class Accelerator(accelerate.Accelerator):
    """`accelerate.Accelerator` whose model and optimizer engine is `backend`.

    `config`: a DeepSpeed-style dict (its `megatrain` section configures the engine; the ZeRO-3 backend runs it
    as its DeepSpeed config), an `EngineConfig`, or None. Settings the config and the arguments both give must
    agree; a `gradient_clipping` in a dict config clips every step (DeepSpeed's meaning) unless the script calls
    `clip_grad_norm_` itself. `gradient_checkpointing=True` turns on Hugging Face's per-layer checkpointing on the
    torch and ZeRO-3 backends; MegaTrain always recomputes per layer, so all three then do the same FLOPs.
    `mixed_precision` None: what `accelerate launch --mixed_precision` set, else "no". Every other keyword is
    accelerate's own (`split_batches`, `dataloader_config`, `rng_types`, `kwargs_handlers`, ...); the ones that
    configure another engine (DeepSpeed, FSDP, Megatron-LM, TP, torch.compile) are refused by name.
    """

    def __init__(
        self,
        backend: str = "megatrain",
        config: dict[str, Any] | EngineConfig | None = None,
        gradient_accumulation_steps: int = 1,
        mixed_precision: str | None = None,
        gradient_checkpointing: bool = False,
        cpu: bool = False,
        gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
        **accelerate_kwargs: Any,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
        check_arguments(accelerate_kwargs)
        kind = backend_class(backend)
        # Before accelerate joins the launch's process group: a stack without gradient averaging would train N
        # unrelated models and report one.
        world = launch_env().world_size
        if world > 1 and not kind.data_parallel:
            raise ValueError(f"backend='torch' runs one process; this launch has WORLD_SIZE={world}. Use "
                             "backend='megatrain' or 'zero3' for data parallel")
        if isinstance(config, dict):
            for section in ("optimizer", "scheduler"):
                if section in config:
                    raise ValueError(
                        f"the config has a {section!r} section; with the Accelerator, build the {section} in the "
                        "script and pass it to prepare() (megatrain.initialize builds them from a config)")
        if gradient_accumulation_plugin is not None:
            if not isinstance(gradient_accumulation_plugin, GradientAccumulationPlugin):
                raise TypeError("gradient_accumulation_plugin must be an accelerate.utils.GradientAccumulationPlugin, "
                                f"got {type(gradient_accumulation_plugin).__name__}")
            if gradient_accumulation_steps != 1:
                raise ValueError("give gradient_accumulation_steps or gradient_accumulation_plugin, not both "
                                 "(as accelerate requires)")
            gradient_accumulation_steps = gradient_accumulation_plugin.num_steps
        else:  # `accelerate launch --gradient_accumulation_steps`, read as accelerate reads it
            gradient_accumulation_steps = int(parse_choice_from_env("ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
                                                                    gradient_accumulation_steps))
        if mixed_precision is None:
            mixed_precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
        # `accelerate launch --cpu` (ACCELERATE_USE_CPU), which accelerate's state reads as cpu=True: the engine too.
        cpu = bool(cpu) or parse_flag_from_env("ACCELERATE_USE_CPU")
        # The config and the arguments, settled once (megatrain/config/resolve.py); an EngineConfig describes
        # MegaTrain's engine only, so a backend that reads none gets no engine settings parsed for it.
        reads_engine = kind.reads_engine_config
        settings = resolve(config, mixed_precision=mixed_precision, gradient_accumulation_steps=gradient_accumulation_steps,
                           cpu=cpu, engine=reads_engine)
        self.settings = settings
        steps = settings.gradient_accumulation_steps
        if gradient_accumulation_plugin is None:
            gradient_accumulation_plugin = GradientAccumulationPlugin(num_steps=steps)
        self.cpu = bool(cpu)
        self.gradient_checkpointing = bool(gradient_checkpointing)
        backend_config = settings.engine if reads_engine else config if isinstance(config, dict) else None
        self.backend: Backend = kind(
            config=backend_config,
            gradient_accumulation_steps=steps,
            mixed_precision=settings.mixed_precision,
            gradient_checkpointing=self.gradient_checkpointing,
            gradient_clipping=settings.gradient_clipping,
            cpu=self.cpu,
        )
        # accelerate's state on the backend's kind of device (cpu=True: the engine runs on the CPU whatever the
        # machine has, and accelerate's device, batches and process group follow it).
        super().__init__(mixed_precision=settings.mixed_precision, cpu=self.cpu or self.backend.device.type == "cpu",
                         gradient_accumulation_plugin=gradient_accumulation_plugin, **accelerate_kwargs)
        # The backend scales and casts itself: accelerate's GradScaler would unscale gradients it never scaled.
        self.scaler = None
        self._stash: dict[int, Any] = {}  # id(user's object) -> what the backend made of it (during one prepare)
        self._live_optimizer: dict[int, torch.optim.Optimizer] = {}  # id(user's optimizer) -> the one stepping
        self._micro_batch_size: int | None = None
        self._no_sync_depth = 0
        self._weights_by_backend = False  # inside save_state / load_state: the backend reads and writes the weights

    @property
    def backend_name(self) -> str:
        return self.backend.name

    # -- gradient accumulation ------------------------------------------------------------------------------
    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"gradient_accumulation_steps={steps!r} must be an int >= 1")
        if self.backend.fixed_accumulation_steps and steps != self.gradient_state.num_steps:
            raise RuntimeError(f"backend {self.backend.name!r}: DeepSpeed fixes the accumulation steps in its config; "
                               "pass gradient_accumulation_steps to the Accelerator instead")
        self.gradient_state.plugin_kwargs.update({"num_steps": steps})

    @contextlib.contextmanager
    def no_sync(self, model: Any = None) -> Iterator[None]:
        """Backwards inside keep their gradients local; they are averaged at the next sync step (`accumulate`
        enters this for the micro-batches that do not sync, as accelerate does)."""
        self._no_sync_depth += 1
        try:
            yield
        finally:
            self._no_sync_depth -= 1

    @contextlib.contextmanager
    def autocast(self, autocast_handler: Any = None) -> Iterator[None]:
        if self.mixed_precision == "bf16" and self.backend.needs_autocast:
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                yield
        else:
            yield  # the other backends cast inside their own forward

    # -- prepare ---------------------------------------------------------------------------------------------
    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """accelerate's prepare; the model and the optimizer passed together go to the backend together (the
        megatrain and zero3 backends take the optimizer over while they take the model)."""
        models = [o for o in args if isinstance(o, torch.nn.Module) and not getattr(o, "_is_accelerate_prepared", False)]
        optimizers = [o for o in args if isinstance(o, torch.optim.Optimizer)
                      and not getattr(o, "_is_accelerate_prepared", False)]
        if len(models) > 1 or len(optimizers) > 1:
            raise ValueError("prepare() takes at most one model and one optimizer per call")
        for o in args:
            if isinstance(o, torch.utils.data.DataLoader) and isinstance(o.batch_size, int):
                self._micro_batch_size = self._micro_batch_size or o.batch_size
        model = models[0] if models else None
        optimizer = optimizers[0] if optimizers else None
        if model is not None:
            self._stash[id(model)] = self._backend_prepare(model, optimizer)
        try:
            return super().prepare(*args, device_placement=device_placement)
        finally:
            self._stash = {}

    def _backend_prepare(self, model: Any, optimizer: torch.optim.Optimizer | None) -> Any:
        if self._models and not self.backend.trains_many_models:
            raise RuntimeError(f"backend {self.backend.name!r} trains one model per Accelerator")
        with self._state_aside():
            prepared, live = self.backend.prepare(model, optimizer, micro_batch_size=self._micro_batch_size)
        if optimizer is not None:
            if live is None:
                raise RuntimeError(f"backend {self.backend.name!r} returned no optimizer for the one passed")
            self._stash[id(optimizer)] = live
        self._say_what_runs()
        return prepared

    @contextlib.contextmanager
    def _state_aside(self) -> Iterator[None]:
        """The ZeRO-3 backends build their engine with accelerate's own DeepSpeed Accelerator, which needs accelerate's
        process-wide state to be a DeepSpeed one: inside, that Accelerator makes its own; after, this one's state
        (and the environment accelerate's DeepSpeed plugin sets) is back, the engine built."""
        if not self.backend.partitions_params:
            yield
            return
        from accelerate.state import AcceleratorState, GradientState

        mine = dict(AcceleratorState._shared_state), dict(GradientState._shared_state)
        env = {k: os.environ.get(k) for k in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_CONFIG_FILE")}
        AcceleratorState._shared_state.clear()
        try:
            yield
        finally:
            for shared, saved in zip((AcceleratorState._shared_state, GradientState._shared_state), mine):
                shared.clear()
                shared.update(saved)
            for k, v in env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> Any:
        """The backend's model (for megatrain the user's own model object, its parameters the engine's host
        masters and its forward the engine's)."""
        prepared = self._stash.pop(id(model), None)
        if prepared is None:
            prepared = self._backend_prepare(model, None)
        self._models.append(prepared)
        return prepared

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> Any:
        if getattr(optimizer, "_is_accelerate_prepared", False):
            return super().prepare_optimizer(optimizer, device_placement)
        live = self._stash.pop(id(optimizer), None)
        if live is None:
            # prepare(model) then prepare(optimizer), as accelerate allows: the backend adopts it.
            _, live = self.backend.prepare(None, optimizer, micro_batch_size=self._micro_batch_size)
            if live is None:
                raise RuntimeError(f"backend {self.backend.name!r} returned no optimizer for the one passed")
        self._live_optimizer[id(optimizer)] = live
        wrapped = AcceleratedOptimizer(live, self.backend)
        self._optimizers.append(wrapped)
        return wrapped

    def prepare_scheduler(self, scheduler: Any) -> Any:
        """accelerate's AcceleratedScheduler (once per process per optimizer step unless split_batches), on the
        optimizer that steps."""
        if getattr(scheduler, "_is_accelerate_prepared", False):
            return super().prepare_scheduler(scheduler)
        opt = getattr(scheduler, "optimizer", None)
        live = self._live_optimizer.get(id(opt))
        if live is None and not any(o.optimizer is opt for o in self._optimizers):
            raise ValueError("prepare the optimizer this scheduler drives before (or together with) the scheduler")
        if live is not None and live is not opt:
            # A backend replaced the optimizer (ZeRO-3 swaps in DeepSpeedCPUAdam). It shares the user's param-group
            # dicts, so the schedule reaches it; check rather than assume.
            if not all(a is b for a, b in zip(opt.param_groups, live.param_groups)):
                scheduler.optimizer = live
        return super().prepare_scheduler(scheduler)

    def prepare_data_loader(self, data_loader: torch.utils.data.DataLoader, device_placement: bool | None = None,
                            slice_fn_for_dispatch: Any = None) -> Any:
        """accelerate's sharded loader. On megatrain its batches stay in host memory (unless `device_placement`
        says otherwise): the engine copies the ids to the device itself, as one asynchronous copy, and reads the
        rest (which labels count, where padding and documents start) where it is; moved to a GPU first, each of
        those reads would be a device sync per micro-batch."""
        if device_placement is None and getattr(self.backend, "says_what_runs", False):
            device_placement = False
        return super().prepare_data_loader(data_loader, device_placement=device_placement,
                                           slice_fn_for_dispatch=slice_fn_for_dispatch)

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

    # -- the training step -----------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backpropagate `loss / gradient_accumulation_steps` (accelerate's scaling) through the backend."""
        if kwargs:
            raise TypeError(f"backward() got unsupported arguments {sorted(kwargs)}")
        sync = self.sync_gradients and self._no_sync_depth == 0
        self.backend.backward(loss / self.gradient_accumulation_steps, sync=sync)

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Nothing to unscale: the backend scales (and unscales) its own gradients."""

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

    def lomo_backward(self, loss: torch.Tensor, learning_rate: float) -> None:
        raise refused("lomo_backward")

    def deepspeed_ulysses_dl_adapter(self, dl: Any, model: Any) -> Any:
        raise refused("deepspeed_ulysses_dl_adapter")

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: Any, even_batches: bool | None = None) -> Iterator[None]:
        raise refused("join_uneven_inputs")
        yield  # pragma: no cover - a generator for contextmanager

    # -- the model back ------------------------------------------------------------------------------------------
    def unwrap_model(self, model: Any, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True) -> Any:
        """The user's model (for megatrain the object `prepare` returned: `save_pretrained` on it writes the
        trained weights, its state_dict being the engine's FP32 masters)."""
        return super().unwrap_model(self.backend.unwrap_model(model), keep_fp32_wrapper, keep_torch_compile)

    def get_state_dict(self, model: Any, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """Every weight of `model` by its HF name, gathered whole whatever the backend. Inside save_state (which asks
        for the weights to hand its hooks) an empty dict: the backend writes the weights itself, and a second copy
        of a model larger than the GPU would be a second copy in host memory."""
        if self._weights_by_backend and not unwrap:
            return {}
        return self.backend.get_state_dict(model)

    def save_model(self, model: Any, save_directory: str | os.PathLike, max_shard_size: int | str = "10GB",
                   safe_serialization: bool = True) -> None:
        """A Hugging Face checkpoint (config + safetensors, which `from_pretrained` loads) written by the backend
        on the main process (gathered first where the backend partitions the weights)."""
        if not safe_serialization:
            raise ValueError("save_model writes safetensors through the backend; safe_serialization=False is not "
                             "supported (accelerator.save(accelerator.get_state_dict(model), path) writes a pickle)")
        if self._replicated_writer_only():
            return
        Path(save_directory).mkdir(parents=True, exist_ok=True)
        self.backend.save_model(model, save_directory)
        self._saved()

    # -- checkpoints: accelerate's save_state / load_state, the weights and optimizer state by the backend -------
    @contextlib.contextmanager
    def _engine_state_by_backend(self, register: Any, on_dir: Any) -> Iterator[None]:
        """Inside, accelerate's save_state / load_state leave the models and optimizers to the backend: the
        optimizers are hidden from accelerate, and a hook run after the user's (so theirs see the models as
        accelerate gives them) takes the models' weights over and hands `on_dir` the folder."""
        optimizers = self._optimizers

        def hook(models: list[Any], *rest: Any) -> None:
            *weights, folder = rest
            # save_state hands its own list of models (keep it); load_state a list it loads into (take them over).
            for listed in weights or [models]:
                listed.clear()
            on_dir(folder)

        handle = register(hook)
        self._optimizers, self._weights_by_backend = [], True
        try:
            yield
        finally:
            self._optimizers, self._weights_by_backend = optimizers, False
            handle.remove()

    def save_state(self, output_dir: str | os.PathLike | None = None, safe_serialization: bool = True,
                   **save_model_func_kwargs: Any) -> Any:
        """accelerate's save_state (folder naming, schedulers, samplers, RNG per process, registered objects,
        hooks); the weights (model.safetensors) and optimizer state (optimizer.bin) written by the backend."""
        state_dir(output_dir, self.project_configuration)  # a clear error where accelerate's is os.makedirs(None)
        if not self._models and not self._optimizers:
            return super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)

        def write(folder: str) -> None:
            # Every rank holds the same weights under megatrain data parallel: the main process writes them (the
            # others take their part in the collective a sharded optimizer state needs), then all wait.
            if not self._replicated_writer_only(lambda: self.backend.save_state(None)):
                self.backend.save_state(folder)
                if self.is_main_process:
                    (Path(folder) / FACE_FILE).write_text(json.dumps({"backend": self.backend.name}))
                self._saved()

        with self._engine_state_by_backend(self.register_save_state_pre_hook, write):
            folder = super().save_state(None if output_dir is None else str(output_dir), safe_serialization,
                                        **save_model_func_kwargs)
        # accelerate returns as soon as this rank wrote its files: here no rank returns before the folder is whole
        # (scheduler, RNG and registered objects written by the main process too), so a rank may read it at once.
        self.wait_for_everyone()
        return folder

    def load_state(self, input_dir: str | os.PathLike | None = None, load_kwargs: dict | None = None,
                   **load_model_func_kwargs: Any) -> None:
        """accelerate's load_state, the weights and optimizer state read by the backend."""
        if not self._models and not self._optimizers:
            super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)
            return

        def read(folder: str) -> None:
            face = Path(folder) / FACE_FILE
            saved = json.loads(face.read_text())["backend"] if face.exists() else None
            if saved != self.backend.name:
                raise ValueError(f"{folder} was saved by backend {saved!r}, not {self.backend.name!r}"
                                 if saved else f"{folder} holds no megatrain.Accelerator state ({FACE_FILE})")
            self.backend.load_state(folder)

        with self._engine_state_by_backend(self.register_load_state_pre_hook, read):
            super().load_state(None if input_dir is None else str(input_dir), load_kwargs, **load_model_func_kwargs)

    def _replicated_writer_only(self, share: Any = None) -> bool:
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

    # -- memory ---------------------------------------------------------------------------------------------------
    def free_memory(self, *objects: Any) -> list[Any]:
        """accelerate's free_memory, the backend's engine forgotten too."""
        release = getattr(self.backend, "release", None)
        if release is not None:
            release()
        self._live_optimizer = {}
        self._micro_batch_size = None
        return super().free_memory(*objects)

    def clear(self, *objects: Any) -> list[Any]:
        return self.free_memory(*objects)


__all__ = ["Accelerator"]
