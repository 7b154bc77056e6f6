"""`DeepSpeedEngine`'s look-alike: what `initialize()` returns.

It follows `DeepSpeedEngine`'s training-loop semantics exactly: `backward()` divides the loss by the
accumulation steps, `step()` only acts at an accumulation boundary (clip, optimizer step, zero grads, LR
schedule step, `global_steps += 1`) and always counts the micro-step. Underneath it holds the MegaTrain
backend, the same one `megatrain.Accelerator(backend="megatrain")` holds, and steps through the same routine
(`megatrain.backend.step`); the model runs on `megatrain.engine.Engine`: weights and optimizer state in host memory,
layers streamed through the device.

`engine.module` is the user's model object, whole: its parameters are the engine's host masters, so
its `state_dict()`, `save_pretrained()`, `generate()` and submodules work as on the plain model, and
its forward runs the engine. Differences that a script can observe are deliberate and documented on
the methods: a training forward with labels builds no logits unless asked (`return_logits=True`),
checkpoints are MegaTrain's crash-consistent format (`megatrain.run.checkpoint`, encoded by
`megatrain.run.train_state`), not DeepSpeed's.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ..backend import MegatrainBackend
from ..backend.step import boundary_step, is_boundary
from ..config.deepspeed import DeepSpeedConfig
from ..files.atomic import atomic_path
from ..run import checkpoint as ckpt
from ..run import train_state
from .data import make_dataloader
from .monitor import Monitor
from .surface import REFUSED, refusal
from .timer import ThroughputTimer
from .utils import log_visible

__all__ = ["MegaTrainEngine", "DeepSpeedEngine"]

class MegaTrainEngine:
    """What `initialize()` returns: a `DeepSpeedEngine` look-alike over `megatrain.engine.Engine`."""

    def __init__(self, backend: MegatrainBackend, config: DeepSpeedConfig, optimizer: torch.optim.Optimizer | None,
                 lr_scheduler: Any, model: nn.Module, training_dataloader: DataLoader | None = None,
                 collate_fn: Callable | None = None) -> None:
        self.backend = backend
        self.engine = engine = backend.engine
        self._config = config
        self.config = config.resolved
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.module = model
        self.training_dataloader = training_dataloader
        self.collate_fn = collate_fn
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        # Data parallel (torchrun & co.): every rank runs one of these over its own engine (engine/parallel/distributed.py).
        self.global_rank, self.local_rank, self.world_size = engine.rank, engine.local_rank, engine.world_size
        self.dp_world_size = self.world_size
        self._is_boundary_override: bool | None = None
        self._no_sync = False
        self._global_grad_norm: float | None = None
        self._step_applied = False
        # What DeepSpeed's engine holds for scripts: its throughput timer (started at each training forward,
        # stopped at each step), its (here disabled) monitor, the parameter names and the data it was given.
        self.tput_timer = ThroughputTimer(config.train_batch_size, steps_per_output=config.steps_per_print)
        self.monitor = Monitor()
        self.param_names = {p: n for n, p in model.named_parameters()}
        self.training_data = training_dataloader.dataset if training_dataloader is not None else None
        self.mp_world_size = 1
        self.dist_backend = (torch.distributed.get_backend() if torch.distributed.is_available()
                             and torch.distributed.is_initialized() else None)

    # -- DeepSpeed's config accessors ---------------------------------------------------------------
    def train_batch_size(self) -> int:
        return self._config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self._config.gradient_accumulation_steps

    def gradient_clipping(self) -> float:
        return self._config.gradient_clipping

    def bfloat16_enabled(self) -> bool:
        return self._config.bf16

    def fp16_enabled(self) -> bool:
        return False

    def zero_optimization(self) -> bool:
        return self._config.zero.stage > 0

    def zero_optimization_stage(self) -> int:
        return self._config.zero.stage

    def steps_per_print(self) -> int | None:
        return self._config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self._config.wall_clock_breakdown

    def dataloader_drop_last(self) -> bool:
        return self._config.dataloader_drop_last

    def get_batch_info(self) -> tuple[int, int, int]:
        """(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps), as DeepSpeed."""
        return self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps()

    def get_data_parallel_rank(self) -> int:
        return self.global_rank

    def get_model_parallel_rank(self) -> int:
        return 0  # data parallel only: every rank holds the whole model

    def get_tensor_parallel_rank(self) -> int:
        return 0

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """(the dtype the model computes in, the dtype gradients accumulate in), as DeepSpeed's."""
        cfg = self.engine.config
        return getattr(torch, cfg.compute_dtype), getattr(torch, cfg.host_grad_dtype)

    def optimizer_name(self) -> str | None:
        return self._config.optimizer.type if self._config.optimizer is not None else None

    def optimizer_params(self) -> dict[str, Any] | None:
        return self.config["optimizer"]["params"] if "optimizer" in self.config else None

    def scheduler_name(self) -> str | None:
        return self._config.scheduler.type if self._config.scheduler is not None else None

    def scheduler_params(self) -> dict[str, Any] | None:
        return self.config["scheduler"]["params"] if "scheduler" in self.config else None

    def is_map_style_dataset(self, obj: Any) -> bool:
        return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")

    def is_iterable_style_dataset(self, obj: Any) -> bool:
        return isinstance(obj, torch.utils.data.IterableDataset)

    @property
    def is_compiled(self) -> bool:
        return False  # compiling the engine is refused (surface.py)

    @property
    def inside_no_sync_ctxt(self) -> bool:
        return self._no_sync

    @property
    def device(self) -> torch.device:
        return self.engine.device

    # -- modes --------------------------------------------------------------------------------------
    def train(self, mode: bool = True) -> MegaTrainEngine:
        self.engine.train(mode)
        return self

    def eval(self) -> MegaTrainEngine:
        return self.train(False)

    @property
    def training(self) -> bool:
        return self.engine.training

    # -- one micro-batch ----------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, input_ids: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> Any:
        """The model's forward (`self.module`, the user's model object, run by the engine).

        `.loss` when labels are given; `.logits` whenever the caller can use them (no labels, eval or
        no_grad, `return_logits=True`); a training step with labels takes the chunked loss and builds
        no logits unless asked. A loss computed from the logits trains through `backward()` as well.
        Positional arguments after input_ids are attention_mask, labels, position_ids (as before).
        """
        if args:
            if len(args) > 3:
                raise TypeError("forward() takes at most input_ids, attention_mask, labels, position_ids positionally")
            for name, value in zip(("attention_mask", "labels", "position_ids"), args):
                if name in kwargs:
                    raise TypeError(f"forward() got {name} both positionally and by keyword")
                kwargs[name] = value
        if self.training:
            self.tput_timer.start()
        return self.module(input_ids, **kwargs)

    def _need_optimizer(self, what: str) -> None:
        if self.optimizer is None:
            raise RuntimeError(f"{what}() needs an optimizer: give one to initialize() or an 'optimizer' section "
                               "in the config")

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Accumulates d(loss / gradient_accumulation_steps)/d(params); returns the scaled loss, as DeepSpeed."""
        self._need_optimizer("backward")
        if retain_graph:
            raise ValueError("retain_graph=True is not supported: each layer's graph is rebuilt during backward")
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise ValueError("backward() takes the scalar loss the forward returned")
        scaled = loss / self.gradient_accumulation_steps() if scale_wrt_gas else loss
        # As DeepSpeed: gradients are averaged across ranks in the boundary micro-batch's backward only.
        self.backend.backward(scaled, sync=self.is_gradient_accumulation_boundary() and not self._no_sync)
        return scaled

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._is_boundary_override is not None:
            return self._is_boundary_override
        return is_boundary(self.micro_steps + 1, self.gradient_accumulation_steps())

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self._is_boundary_override = is_boundary

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """Counts a micro-step; at an accumulation boundary also clips, steps optimizer and schedule, zeros grads."""
        self._need_optimizer("step")
        self._step_applied = False
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            self._take_model_step(lr_kwargs)
        self.tput_timer.stop(global_step=boundary, report_speed=self.global_rank == 0)
        self.micro_steps += 1

    def _take_model_step(self, lr_kwargs: dict[str, Any] | None) -> None:
        # The backend clips by the config's gradient_clipping; a step it skips (gradients not finite) is counted
        # as DeepSpeed counts its fp16 overflow: the schedule stays where it is, global_steps still advances.
        applied = boundary_step(self.backend, zero_grad=True)
        self._global_grad_norm = self.backend.last_grad_norm
        self._step_applied = applied
        if not applied:
            self.skipped_steps += 1
        elif self.lr_scheduler is not None:
            self.lr_scheduler.step(**(lr_kwargs or {}))
        every = self.steps_per_print()
        if every is not None and (self.global_steps + 1) % every == 0:
            betas = [g.get("betas") for g in self.optimizer.param_groups]
            log_visible("step=%d, skipped=%d, lr=%s, mom=%s", self.global_steps + 1, self.skipped_steps, self.get_lr(),
                        betas)
        if self.wall_clock_breakdown():
            # No sync (accounting.take_phases): the calls' own time on this thread, the copy waits as they finish.
            s = self.engine.accounting.take_phases()
            log_visible("time (ms) | forward: %.2f | backward: %.2f | step: %.2f | copy wait: %.2f",
                        1e3 * s["forward_s"], 1e3 * s["backward_s"], 1e3 * s["optimizer_s"], 1e3 * s["copy_wait_s"])
        self.global_steps += 1
        self.global_samples += self.train_batch_size()

    def zero_grad(self) -> None:
        self.backend.zero_grad()

    def was_step_applied(self) -> bool:
        return self._step_applied

    def get_global_grad_norm(self) -> float | None:
        """Norm before clipping at the last boundary (None when clipping is off: it is not computed then)."""
        return self._global_grad_norm

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups] if self.optimizer is not None else []

    def get_mom(self) -> list[Any]:
        return [g.get("betas", g.get("momentum")) for g in self.optimizer.param_groups] if self.optimizer else []

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside keep their gradients local (data parallel); the next step averages them."""
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    def deepspeed_io(self, dataset: Dataset, batch_size: int | None = None, route: str = "train",
                     pin_memory: bool = True, data_sampler: Any = None, collate_fn: Callable | None = None,
                     num_local_io_workers: int | None = None) -> DataLoader:
        return make_dataloader(dataset, batch_size or self.train_micro_batch_size_per_gpu(),
                               collate_fn or self.collate_fn, self._config.dataloader_drop_last, data_sampler,
                               num_local_io_workers or 0, self.dp_world_size, self.global_rank)

    # -- weights out -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """HF-named FP32 copies of every parameter (tied weights under each name)."""
        return self.engine.state_dict()

    module_state_dict = state_dict

    def _export_tensors(self, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        """Each distinct weight once under its HF name (tied ones under their first name, as HF saves them)."""
        out = {}
        for name, p in self.engine.named_parameters():
            t = p.detach()
            out[name] = t if dtype is None or t.dtype == dtype else t.to(dtype)
        return out

    def save_16bit_model(self, save_dir: str | os.PathLike, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """The weights in the compute dtype (bf16 when bf16 is on, else FP32), as DeepSpeed's save_16bit_model.

        `*.bin` is a `torch.save`d state dict like DeepSpeed's; `*.safetensors` is safetensors. A
        config.json is written next to it so the directory loads with `AutoModelForCausalLM`.
        """
        save_dir = Path(save_dir)
        save_dir.mkdir(parents=True, exist_ok=True)
        dtype = torch.bfloat16 if self.bfloat16_enabled() else torch.float32
        if save_filename.endswith(".safetensors"):
            ckpt.write_safetensors(save_dir / save_filename, self._export_tensors(dtype), {"format": "pt"})
        else:
            sd = {k: v.to(dtype) for k, v in self.engine.state_dict().items()}
            with atomic_path(save_dir / save_filename) as tmp:
                torch.save(sd, tmp)
        self._save_hf_config(save_dir, dtype)
        return True

    def save_pretrained(self, save_directory: str | os.PathLike, dtype: torch.dtype | None = None,
                        max_shard_size: int = 5 * 10**9) -> Path:
        """A Hugging Face checkpoint (safetensors + config.json) that `from_pretrained` loads (the model's own class:
        a causal LM's, a sequence classifier's).

        Weights in the dtype the config asks for, as DeepSpeed saves them: bf16 (rounded from the FP32 masters) with
        `bf16.enabled`, else the FP32 masters; `dtype` overrides it. config.json names that dtype. Larger exports are
        sharded with an index file as HF does. Tensors are streamed to disk, never copied whole.
        """
        save_directory = Path(save_directory)
        save_directory.mkdir(parents=True, exist_ok=True)
        if dtype is None:
            dtype = torch.bfloat16 if self.bfloat16_enabled() else torch.float32
        tensors = self._export_tensors(dtype)
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, t in tensors.items():
            n = t.numel() * t.element_size()
            if shards[-1] and size + n > max_shard_size:
                shards.append({})
                size = 0
            shards[-1][name] = t
            size += n
        if len(shards) == 1:
            ckpt.write_safetensors(save_directory / "model.safetensors", shards[0], {"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards, 1):
                fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                ckpt.write_safetensors(save_directory / fname, shard, {"format": "pt"})
                weight_map.update(dict.fromkeys(shard, fname))
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            ckpt.write_json(save_directory / "model.safetensors.index.json", index)
        self._save_hf_config(save_directory, dtype)
        return save_directory

    save_fp16_model = save_16bit_model  # DeepSpeed's older name

    def _save_hf_config(self, directory: Path, dtype: torch.dtype) -> None:
        import copy

        cfg = copy.deepcopy(self.engine.hf_config)
        # transformers 5 names it `dtype`; older versions only know `torch_dtype`.
        setattr(cfg, "dtype" if hasattr(cfg, "dtype") else "torch_dtype", dtype)
        cfg.save_pretrained(directory)
        gen = getattr(self.module, "generation_config", None)
        if gen is not None:
            with contextlib.suppress(Exception):  # an unsaveable generation config must not cost the weights
                gen.save_pretrained(directory)

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """True whatever the config says: the weights are whole on the host, so a model save never needs a
        gather and is never skipped (DeepSpeed at stage 3 would save no weights when this is false)."""
        return True

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
        """What accelerate / Trainer save at stage 3: every weight, copies of the FP32 masters, in bf16 when the
        config's bf16 is on (DeepSpeed's dtype there). Copies, as DeepSpeed's gather makes: the masters of a layer are views of one flat buffer, and
        accelerate's `save_model` keeps one tensor per storage (it saved 3 of 21 tensors of a tiny Llama)."""
        weights = self.engine.state_dict()  # the masters, whatever the host mode; buffers from the model
        sd = {k: weights[k] if k in weights else v.detach().clone() for k, v in self.module.state_dict().items()}
        if self.bfloat16_enabled():  # the dtype the config asks for, as DeepSpeed's 16-bit gather gives it
            sd = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in sd.items()}
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            sd = {k: v for k, v in sd.items() if k not in frozen}
        return sd

    # -- checkpoints --------------------------------------------------------------------------------
    def save_checkpoint(self, save_dir: str | os.PathLike, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False,
                        keep_last: int | None = None) -> bool:
        """Everything needed to continue bit-exactly: FP32 masters, optimizer state, LR schedule, counters,
        RNG states, config and `client_state` (any picklable objects, as DeepSpeed), written crash-consistently.

        `keep_last=N` (MegaTrain's addition) deletes all but the N newest checkpoints afterwards.
        """
        tag = tag if tag is not None else f"global_step{self.global_steps}"
        counters = {"global_steps": self.global_steps, "global_samples": self.global_samples,
                    "micro_steps": self.micro_steps, "skipped_steps": self.skipped_steps}
        mine = train_state.shard_params(self.engine) if self.optimizer is not None else None
        if mine is not None:
            # One host store per node: each rank writes its own layers' optimizer state as a shard, no gather.
            weights, _ = self.backend.training_state(with_optimizer=False)
            train_state.save_engine_checkpoint_sharded(
                save_dir, tag, weights=weights, optimizer=self.engine.optimizer, mine=mine, rank=self.global_rank,
                group=self.engine.dp.group, scheduler=self.lr_scheduler, counters=counters, config=self.config,
                client_state=client_state, keep_last=keep_last, update_latest=save_latest,
                residency=train_state.residency_record(self.engine))
            torch.distributed.barrier()  # no rank reads it (or moves on to delete it) before it is whole
            return True
        # Layer updates still queued (optimizer_overlap) land first.
        weights, optimizer_state = self.backend.training_state(with_optimizer=self.optimizer is not None)
        # Data parallel: every rank holds the same weights and optimizer state, so rank 0 writes them for all
        # (with its RNG states) and the checkpoint resumes on any number of ranks.
        train_state.save_engine_checkpoint(
            save_dir, tag, weights=weights, optimizer_state=optimizer_state, scheduler=self.lr_scheduler,
            counters=counters, config=self.config, client_state=client_state, write=self.global_rank == 0,
            keep_last=keep_last, update_latest=save_latest, residency=train_state.residency_record(self.engine))
        if self.world_size > 1:
            torch.distributed.barrier()  # no rank reads it (or moves on to delete it) before it is whole
        return True

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Callable | None = None
                        ) -> tuple[str | None, dict | None]:
        """Restores a `save_checkpoint` checkpoint (checksums verified) -> (its path, client_state).

        As in DeepSpeed, with no tag and no `latest` file it warns and returns (None, None).
        """
        if custom_load_fn is not None:
            raise ValueError("custom_load_fn is not supported by MegaTrain checkpoints")
        if tag is None and ckpt.latest_tag(load_dir) is None:
            warnings.warn(f"Unable to find latest file at {Path(load_dir) / ckpt.LATEST_FILE}; nothing loaded",
                          stacklevel=2)
            return None, None
        weights, meta, path, tensors = train_state.load_engine_checkpoint(load_dir, tag)
        # The engine was built before the checkpoint was read: where its run placed another optimizer-resident count
        # (chosen from that card's free memory), this resume trains other bits; said, not hidden.
        differs = train_state.resumed_residency(self.engine, train_state.saved_residency(meta))
        if differs is not None:
            warnings.warn(differs, stacklevel=2)
        optimizer_state = None
        if (not load_module_only and load_optimizer_states and self.optimizer is not None
                and "optimizer" in meta):
            self.engine.synchronize()  # queued layer updates land before their state is read into in place
            optimizer_state = train_state.optimizer_from(meta, tensors, self.engine.optimizer,
                                                         skip=train_state.foreign_params(self.engine))
        self.backend.load_training_state(weights, optimizer_state, strict=load_module_strict)
        if not load_module_only:
            if load_lr_scheduler_states and self.lr_scheduler is not None and meta.get("lr_scheduler") is not None:
                self.lr_scheduler.load_state_dict(meta["lr_scheduler"])
            c = meta["counters"]
            self.global_steps, self.global_samples = c["global_steps"], c["global_samples"]
            self.micro_steps, self.skipped_steps = c["micro_steps"], c["skipped_steps"]
            train_state.restore_rng(meta, tensors)
        return str(path), train_state.client_state_from(meta, tensors)

    # -- passthrough ---------------------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        # Like DeepSpeedEngine: attributes it does not have come from the wrapped model (config, ...).
        if name.startswith("__") or "module" not in self.__dict__:
            raise AttributeError(name)
        if name in REFUSED:  # DeepSpeedEngine's names MegaTrain does not answer, each with its reason
            raise AttributeError(refusal(name))
        return getattr(self.__dict__["module"], name)

    def __repr__(self) -> str:
        return (f"MegaTrainEngine({type(self.module).__name__}, global_steps={self.global_steps}, "
                f"micro_steps={self.micro_steps}, device={self.device})")


DeepSpeedEngine = MegaTrainEngine
