"""The DeepSpeed-compatible face: `import megatrain as deepspeed` and a DeepSpeed script runs unchanged.

`initialize()` takes the same arguments as `deepspeed.initialize` and returns the same four things;
the engine it returns follows `DeepSpeedEngine`'s training-loop semantics exactly: `backward()`
divides the loss by the accumulation steps, `step()` only acts at an accumulation boundary (clip,
optimizer step, zero grads, LR schedule step, `global_steps += 1`) and always counts the
micro-step, and the LR schedules are DeepSpeed's, first steps included. Underneath, the model runs
on `megatrain.engine.Engine`: weights and optimizer state in host memory, layers streamed through
the device.

`engine.module` is the user's model object, whole: its parameters are the engine's host masters, so
its `state_dict()`, `save_pretrained()`, `generate()` and submodules work as on the plain model, and
its forward runs the engine. Differences that a script can observe are deliberate and documented on
the methods: a training forward with labels builds no logits unless asked (`return_logits=True`),
checkpoints are MegaTrain's crash-consistent format (`megatrain.checkpoint`), not DeepSpeed's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import socket
import sys
import types
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from . import checkpoint as ckpt
from .config import EngineConfig
from .dsconfig import DeepSpeedConfig, parse_config
from .integrations.fused_head import serve_fused_lm_head, trl_head_options

__all__ = ["initialize", "MegaTrainEngine", "DeepSpeedEngine", "init_distributed", "add_config_arguments", "zero",
           "comm"]

logger = logging.getLogger("megatrain")


def _log(msg: str, *args: Any) -> None:
    # DeepSpeed's steps_per_print / wall_clock_breakdown lines are meant to be seen; without a configured
    # handler an INFO record would be dropped, so give the logger one of its own, once.
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[megatrain] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    logger.info(msg, *args)

_CKPT_KIND = "megatrain.deepspeed_engine"
_MODEL = "model."
_OPTIM = "optim."
_CLIENT = "client."
_RNG = "rng."


# ---------------------------------------------------------------------------------------------------
# the engine


class MegaTrainEngine:
    """What `initialize()` returns: a `DeepSpeedEngine` look-alike over `megatrain.engine.Engine`."""

    def __init__(self, engine: Any, config: DeepSpeedConfig, optimizer: torch.optim.Optimizer | None,
                 lr_scheduler: Any, model: nn.Module, training_dataloader: DataLoader | None = None,
                 collate_fn: Callable | None = None) -> None:
        self.engine = engine
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
        # Data parallel (torchrun & co.): every rank runs one of these over its own engine (engine/distributed.py).
        dp = getattr(engine, "dp", None)
        self.global_rank = dp.rank if dp is not None else 0
        self.local_rank = dp.local_rank if dp is not None else 0
        self.world_size = dp.world_size if dp is not None else 1
        self.dp_world_size = self.world_size
        self._is_boundary_override: bool | None = None
        self._no_sync = False
        self._global_grad_norm: float | None = None
        self._step_applied = False

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
        self.engine.backward(scaled, sync=self.is_gradient_accumulation_boundary() and not self._no_sync)
        return scaled

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._is_boundary_override is not None:
            return self._is_boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self._is_boundary_override = is_boundary

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """Counts a micro-step; at an accumulation boundary also clips, steps optimizer and schedule, zeros grads."""
        self._need_optimizer("step")
        self._step_applied = False
        if self.is_gradient_accumulation_boundary():
            self._take_model_step(lr_kwargs)
        self.micro_steps += 1

    def _take_model_step(self, lr_kwargs: dict[str, Any] | None) -> None:
        clip = self.gradient_clipping()
        self._global_grad_norm = self.engine.clip_grad_norm_(clip) if clip > 0 else None
        # The engine skips a step whose gradients are not finite; DeepSpeed treats its fp16 overflow the
        # same way: count it, leave the schedule where it is, but still advance global_steps.
        applied = self.engine.step() is not False
        self.engine.zero_grad()
        self._step_applied = applied
        if not applied:
            self.skipped_steps += 1
        elif self.lr_scheduler is not None:
            self.lr_scheduler.step(**(lr_kwargs or {}))
        every = self.steps_per_print()
        if every is not None and (self.global_steps + 1) % every == 0:
            betas = [g.get("betas") for g in self.optimizer.param_groups]
            _log("step=%d, skipped=%d, lr=%s, mom=%s", self.global_steps + 1, self.skipped_steps, self.get_lr(),
                        betas)
        if self.wall_clock_breakdown():
            s = self.engine.stats
            _log("time (ms) | forward: %.2f | backward: %.2f | step: %.2f | copy wait: %.2f",
                        1e3 * s["forward_s"], 1e3 * s["backward_s"], 1e3 * s["optimizer_s"], 1e3 * s["copy_wait_s"])
            self.engine.reset_stats()
        self.global_steps += 1
        self.global_samples += self.train_batch_size()

    def zero_grad(self) -> None:
        self.engine.zero_grad()

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
        return _dataloader(dataset, batch_size or self.train_micro_batch_size_per_gpu(),
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
            tmp = save_dir / f".{save_filename}.tmp"
            torch.save(sd, tmp)
            os.replace(tmp, save_dir / save_filename)
        self._save_hf_config(save_dir, dtype)
        return True

    def save_pretrained(self, save_directory: str | os.PathLike, dtype: torch.dtype | None = None,
                        max_shard_size: int = 5 * 10**9) -> Path:
        """A Hugging Face checkpoint (safetensors + config.json) that `AutoModelForCausalLM.from_pretrained` loads.

        Weights are the FP32 masters unless `dtype` says otherwise; larger exports are sharded with
        an index file as HF does. Tensors are streamed to disk, never copied whole.
        """
        save_directory = Path(save_directory)
        save_directory.mkdir(parents=True, exist_ok=True)
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
        self._save_hf_config(save_directory, dtype or torch.float32)
        return save_directory

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
        """What accelerate / Trainer save at stage 3: every weight, the FP32 masters (nothing is 16-bit here)."""
        sd = self.module.state_dict()
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
        self.engine.synchronize()  # layer updates still queued (optimizer_overlap) land first
        tensors: dict[str, torch.Tensor] = {}
        for name, p in self.engine.named_parameters():
            tensors[_MODEL + name] = p.detach()
        meta: dict[str, Any] = {
            "kind": _CKPT_KIND,
            "version": 1,
            "counters": {"global_steps": self.global_steps, "global_samples": self.global_samples,
                         "micro_steps": self.micro_steps, "skipped_steps": self.skipped_steps},
            "config": self.config,
            "lr_scheduler": _scheduler_state(self.lr_scheduler),
        }
        if self.optimizer is not None:
            meta["optimizer"] = _optimizer_state(self.optimizer, tensors)
        meta["rng"] = _rng_state(tensors)
        meta["client_state"] = _split_client_state(client_state or {}, tensors)
        # Data parallel: every rank holds the same weights and optimizer state, so rank 0 writes them for all
        # (with its RNG states) and the checkpoint resumes on any number of ranks.
        if self.global_rank == 0:
            ckpt.save(save_dir, tag, tensors, meta, keep_last=keep_last, update_latest=save_latest)
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
        tensors, meta, path = ckpt.load(load_dir, tag)
        if meta.get("kind") != _CKPT_KIND:
            raise ckpt.CheckpointError(f"{path} is not a checkpoint written by MegaTrainEngine.save_checkpoint")
        model_sd = {k[len(_MODEL):]: v for k, v in tensors.items() if k.startswith(_MODEL)}
        self.engine.load_state_dict(model_sd, strict=load_module_strict)
        self.engine.zero_grad()
        self.engine.synchronize()
        if not load_module_only:
            if load_optimizer_states and self.optimizer is not None and "optimizer" in meta:
                self.optimizer.load_state_dict(_optimizer_from(meta["optimizer"], tensors))
            if load_lr_scheduler_states and self.lr_scheduler is not None and meta.get("lr_scheduler") is not None:
                self.lr_scheduler.load_state_dict(meta["lr_scheduler"])
            c = meta["counters"]
            self.global_steps, self.global_samples = c["global_steps"], c["global_samples"]
            self.micro_steps, self.skipped_steps = c["micro_steps"], c["skipped_steps"]
            _restore_rng(meta["rng"], tensors)
        client = _join_client_state(meta.get("client_state", {}), tensors)
        return str(path), client

    # -- passthrough ---------------------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        # Like DeepSpeedEngine: attributes it does not have come from the wrapped model (config, ...).
        if name.startswith("__") or "module" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["module"], name)

    def __repr__(self) -> str:
        return (f"MegaTrainEngine({type(self.module).__name__}, global_steps={self.global_steps}, "
                f"micro_steps={self.micro_steps}, device={self.device})")


DeepSpeedEngine = MegaTrainEngine


# ---------------------------------------------------------------------------------------------------
# checkpoint state helpers


def _json_value(v: Any, what: str) -> Any:
    if torch.is_tensor(v):
        if v.numel() != 1:
            raise TypeError(f"{what}: a non-scalar tensor where a hyper-parameter was expected")
        return {"__tensor__": v.item(), "dtype": str(v.dtype).removeprefix("torch.")}
    if isinstance(v, tuple):
        return {"__tuple__": [_json_value(x, what) for x in v]}
    return v


def _from_json_value(v: Any) -> Any:
    if isinstance(v, dict) and "__tensor__" in v:
        return torch.tensor(v["__tensor__"], dtype=getattr(torch, v["dtype"]))
    if isinstance(v, dict) and "__tuple__" in v:
        return tuple(_from_json_value(x) for x in v["__tuple__"])
    return v


def _optimizer_state(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    sd = opt.state_dict()
    state_meta: dict[str, dict[str, Any]] = {}
    for idx, st in sd["state"].items():
        entry = {}
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"{_OPTIM}{idx}.{k}"] = v
                entry[k] = "__in_tensors__"
            else:
                entry[k] = _json_value(v, f"optimizer state {k}")
        state_meta[str(idx)] = entry
    groups = [{k: _json_value(v, f"param group {k}") for k, v in g.items()} for g in sd["param_groups"]]
    return {"state": state_meta, "param_groups": groups}


def _optimizer_from(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    state = {}
    for idx, entry in meta["state"].items():
        state[int(idx)] = {k: tensors[f"{_OPTIM}{idx}.{k}"] if v == "__in_tensors__" else _from_json_value(v)
                           for k, v in entry.items()}
    groups = [{k: _from_json_value(v) for k, v in g.items()} for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


def _scheduler_state(sched: Any) -> Any:
    if sched is None or not hasattr(sched, "state_dict"):
        return None
    return {k: _json_value(v, f"lr scheduler {k}") for k, v in sched.state_dict().items()}


def _rng_state(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    tensors[_RNG + "torch"] = torch.get_rng_state()
    n_cuda = 0
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"{_RNG}cuda.{i}"] = s
            n_cuda += 1
    version, mt_state, gauss = random.getstate()
    out: dict[str, Any] = {"python": [version, list(mt_state), gauss], "cuda_devices": n_cuda}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        tensors[_RNG + "numpy"] = torch.from_numpy(keys.astype(np.int64))
        out["numpy"] = [kind, pos, has_gauss, cached]
    except ImportError:
        pass
    return out


def _restore_rng(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(tensors[_RNG + "torch"])
    if meta.get("cuda_devices") and torch.cuda.is_available():
        states = [tensors[f"{_RNG}cuda.{i}"] for i in range(meta["cuda_devices"])]
        torch.cuda.set_rng_state_all(states[: torch.cuda.device_count()])
    version, mt_state, gauss = meta["python"]
    random.setstate((version, tuple(mt_state), gauss))
    if "numpy" in meta and _RNG + "numpy" in tensors:
        import numpy as np

        kind, pos, has_gauss, cached = meta["numpy"]
        np.random.set_state((kind, tensors[_RNG + "numpy"].numpy().astype(np.uint32), pos, has_gauss, cached))


def _split_client_state(state: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """`client_state` as DeepSpeed keeps it: any picklable objects, pickled (torch.save) into one byte tensor, so
    tuples, namespaces and tensors come back as they went in, covered by the checkpoint's checksums."""
    import io
    import pickle

    buf = io.BytesIO()
    try:
        torch.save(dict(state), buf)
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        for key, value in state.items():
            try:
                torch.save(value, io.BytesIO())
            except (pickle.PicklingError, TypeError, AttributeError):
                raise TypeError(f"client_state[{key!r}] cannot be saved ({e}); client_state must be picklable, "
                                "as DeepSpeed requires") from e
        raise TypeError(f"client_state cannot be saved ({e}); it must be picklable, as DeepSpeed requires") from e
    tensors[_CLIENT + "pickle"] = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    return {"__pickled__": True}


def _join_client_state(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    if meta.get("__pickled__"):
        import io

        # The checkpoint's own bytes, checksum-verified: the same trust DeepSpeed's torch.load gives them.
        return torch.load(io.BytesIO(tensors[_CLIENT + "pickle"].numpy().tobytes()), weights_only=False)
    # checkpoints written before client_state was pickled: JSON values and tensors
    return {k: tensors[f"{_CLIENT}{k}"] if v == "__in_tensors__" else v for k, v in meta.items()}


# ---------------------------------------------------------------------------------------------------
# initialize


def _dataloader(dataset: Any, batch_size: int, collate_fn: Callable | None, drop_last: bool, sampler: Any = None,
                num_workers: int = 0, world_size: int = 1, rank: int = 0) -> DataLoader:
    if isinstance(dataset, IterableDataset):
        return DataLoader(dataset, batch_size=batch_size, collate_fn=collate_fn, drop_last=drop_last,
                          num_workers=num_workers)
    # DeepSpeed samples with a DistributedSampler over the data-parallel ranks (shuffled, seed 0, never
    # re-seeded per epoch); using the same sampler keeps the data order of a ported script identical.
    sampler = sampler if sampler is not None else DistributedSampler(dataset, num_replicas=world_size, rank=rank)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn, drop_last=drop_last,
                      num_workers=num_workers)


def _param_groups(model: nn.Module, model_parameters: Any) -> list[dict[str, Any]] | None:
    """`model_parameters` (tensors or param-group dicts over `model`'s parameters) as groups of names."""
    if model_parameters is None:
        return None
    names = {id(p): n for n, p in model.named_parameters()}

    def to_names(params: Any) -> list[str]:
        params = [params] if torch.is_tensor(params) else list(params)
        out = []
        for p in params:
            if id(p) not in names:
                raise ValueError("model_parameters holds a tensor that is not a parameter of `model`")
            if p.requires_grad:
                out.append(names[id(p)])
        return out

    items = list(model_parameters)
    if items and all(isinstance(g, dict) for g in items):
        return [{**{k: v for k, v in g.items() if k != "params"}, "params": to_names(g["params"])} for g in items]
    return [{"params": to_names(items)}]


def _on_engine(groups: list[dict[str, Any]] | None, named: list[tuple[str, nn.Parameter]]) -> list[Any]:
    if groups is None:
        return [p for _, p in named]
    by_name = dict(named)
    out = []
    for g in groups:
        missing = [n for n in g["params"] if n not in by_name]
        if missing:
            raise ValueError(f"model_parameters names {missing[0]!r}, which the engine does not hold")
        out.append({**g, "params": [by_name[n] for n in g["params"]]})
    return out


def _resolve_config(args: Any, config: Any, config_params: Any) -> Any:
    if config is not None and config_params is not None:
        raise ValueError("give the DeepSpeed config as `config` or `config_params`, not both")
    config = config if config is not None else config_params
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if from_args is not None:
        if config is not None:
            raise ValueError("a DeepSpeed config was given both in args.deepspeed_config and to initialize(); "
                             "keep one")
        config = from_args
    if config is None:
        raise ValueError("initialize() needs a DeepSpeed config: pass config=<dict or path to .json> "
                         "(or args.deepspeed_config)")
    return config


def initialize(args: Any = None, model: nn.Module | None = None, optimizer: Any = None, model_parameters: Any = None,
               training_data: Any = None, lr_scheduler: Any = None, distributed_port: int | None = None,
               mpu: Any = None, dist_init_required: bool | None = None, collate_fn: Callable | None = None,
               config: dict[str, Any] | str | os.PathLike | None = None, mesh_param: Any = None,
               config_params: dict[str, Any] | str | os.PathLike | None = None
               ) -> tuple[MegaTrainEngine, torch.optim.Optimizer | None, DataLoader | None, Any]:
    """`deepspeed.initialize`, on MegaTrain: returns (engine, optimizer, training dataloader, lr scheduler).

    The config is parsed and validated completely before the model is touched. `optimizer` may be a
    torch optimizer over `model.parameters()` (taken over by the engine) or a callable taking the
    parameters; otherwise the config's optimizer section is used (over `model_parameters` when
    given, which may be param groups). `lr_scheduler` may be a scheduler or a callable taking the
    optimizer; otherwise the config's scheduler section is used.
    """
    from .engine import Engine
    from .engine.distributed import launch_env
    from .engine.engine import resolve_device

    world = launch_env().world_size  # a malformed launch environment is refused here, before the config
    cfg = parse_config(_resolve_config(args, config, config_params), args=args, world_size=world)
    if model is None:
        raise ValueError("initialize() needs a model (a Hugging Face causal LM)")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a Hugging Face causal LM), got {type(model).__name__}")
    if mpu is not None or mesh_param is not None:
        raise ValueError("mpu / mesh_param (model or pipeline parallel groups) are not supported: MegaTrain's only "
                         "parallelism is data parallel over all ranks of the launch")
    if isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler) and not isinstance(optimizer,
                                                                                          torch.optim.Optimizer):
        raise ValueError("an instantiated lr_scheduler needs the optimizer it was built on passed as `optimizer`")
    if optimizer is not None and cfg.optimizer is not None:
        warnings.warn("both an optimizer and a config 'optimizer' section were given; using the optimizer passed in "
                      "(as DeepSpeed does)", stacklevel=2)
    has_optimizer = optimizer is not None or cfg.optimizer is not None
    if cfg.scheduler is not None and lr_scheduler is None and not has_optimizer:
        raise ValueError("the config's 'scheduler' section needs an optimizer (an 'optimizer' section or one passed in)")

    engine_cfg = cfg.engine
    if engine_cfg.pin_memory and resolve_device(engine_cfg.device).type != "cuda":
        # Pinning only speeds up host->CUDA copies; DeepSpeed configs ask for it by habit.
        engine_cfg = EngineConfig.from_dict({**engine_cfg.to_dict(), "pin_memory": False})

    groups = _param_groups(model, model_parameters)
    if isinstance(optimizer, torch.optim.Optimizer):
        # Checked here because the engine finds out only after it has packed the model into its store.
        own = {id(p) for p in model.parameters()}
        if any(id(p) not in own for g in optimizer.param_groups for p in g["params"]):
            raise ValueError("the optimizer holds a tensor that is not a parameter of `model`; build it over "
                             "model.parameters()")
        engine_opt: Any = optimizer
    elif optimizer is not None:
        if not callable(optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer or a callable, got {type(optimizer).__name__}")
        client = optimizer

        def engine_opt(named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
            return client(_on_engine(groups, named))
    elif cfg.optimizer is not None:
        spec = cfg.optimizer

        def engine_opt(named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
            return spec.build(_on_engine(groups, named))
    else:
        engine_opt = None

    if getattr(model, "is_gradient_checkpointing", False):
        # Trainer / TRL switch HF's checkpointing on (TRL by default). The engine already recomputes each layer
        # from its boundary activation; HF's own checkpoint would recompute again, outside the engine's binding.
        model.gradient_checkpointing_disable()
    head_options = trl_head_options(model)  # TRL's fused-head patch, before the engine replaces the forward
    eng = Engine(model, config=engine_cfg, optimizer=engine_opt)
    serve_fused_lm_head(model, head_options)
    opt = eng.optimizer if has_optimizer else None

    if lr_scheduler is not None:
        is_sched = hasattr(lr_scheduler, "step") and hasattr(lr_scheduler, "state_dict")
        sched = lr_scheduler if is_sched or not callable(lr_scheduler) else lr_scheduler(opt)
    elif cfg.scheduler is not None:
        sched = cfg.scheduler.build(opt)
    else:
        sched = None

    loader = None
    if training_data is not None:
        loader = _dataloader(training_data, cfg.train_micro_batch_size_per_gpu, collate_fn, cfg.dataloader_drop_last,
                             world_size=eng.world_size, rank=eng.rank)
    engine = MegaTrainEngine(eng, cfg, opt, sched, model, loader, collate_fn)
    return engine, opt, loader, sched


# ---------------------------------------------------------------------------------------------------
# the rest of the `deepspeed` namespace a training script touches


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout: Any = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config: Any = None, rank: int = -1,
                     world_size: int = -1) -> None:
    """The process group DeepSpeed would set up: the launch's ranks from its environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT), else a one-process group, so `torch.distributed.get_rank()` in a script works.
    The backend is `dist_backend`, else NCCL on CUDA and gloo otherwise (the engine averages its host
    gradients on a gloo group of its own either way)."""
    import torch.distributed as dist

    if dist_init_required is False or not dist.is_available() or dist.is_initialized():
        return
    env_world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    world = world_size if world_size > 0 else env_world
    if world > 1:
        from .engine.distributed import launch_env

        if world != env_world:
            raise ValueError(f"world_size={world} but WORLD_SIZE={env_world}: launch every rank with torchrun, "
                             "accelerate launch or the deepspeed launcher")
        env = launch_env()
        backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
        kwargs = {"timeout": timeout} if timeout is not None else {}
        dist.init_process_group(backend=backend, init_method=init_method or "env://", rank=env.rank,
                                world_size=world, **kwargs)
        return
    if init_method is None:
        if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
            init_method = "env://"
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    kwargs = {"timeout": timeout} if timeout is not None else {}
    # The group only answers rank/world-size queries: gloo needs no accelerator whatever the device.
    dist.init_process_group(backend="gloo", init_method=init_method, rank=0, world_size=1, **kwargs)


def add_config_arguments(parser: Any) -> Any:
    """DeepSpeed's command-line flags (--deepspeed, --deepspeed_config), so `args.deepspeed_config` works."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true", help="enable the DeepSpeed(-style) engine")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file")
    return parser


class _NoOpContext(contextlib.ContextDecorator):
    """Stands in for deepspeed.zero.Init: the model is built whole on the host, as it is."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __enter__(self) -> _NoOpContext:
        return self

    def __exit__(self, *exc: Any) -> bool:
        return False


class GatheredParameters(contextlib.ContextDecorator):
    """`deepspeed.zero.GatheredParameters`: the parameters are whole already (the model object's parameters are
    the engine's host masters); entering waits for queued updates so reads are current, and with a
    `modifier_rank` leaving hands what was written to the engine (its device and bf16 copies follow)."""

    def __init__(self, params: Any, modifier_rank: int | None = None, fwd_module: Any = None,
                 enabled: bool = True) -> None:
        params = [params] if torch.is_tensor(params) else list(params or [])
        from .engine.engine import engines_holding

        self._engines = engines_holding(params) if enabled else []
        self._modifier_rank = modifier_rank

    def __enter__(self) -> GatheredParameters:
        for eng in self._engines:
            eng.synchronize()
        return self

    def __exit__(self, *exc: Any) -> bool:
        if self._modifier_rank is not None:
            for eng in self._engines:
                eng.params_written(self._modifier_rank)
        return False


zero = types.SimpleNamespace(Init=_NoOpContext, GatheredParameters=GatheredParameters)
from . import comm  # noqa: E402  (after init_distributed, which it re-exports lazily)


class _CallableModule(types.ModuleType):
    """`megatrain.initialize(...)` must call the function even after this submodule has been imported:
    importing `megatrain.initialize` binds the package attribute `initialize` to this module,
    shadowing the function the package exports under the same name."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return initialize(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
