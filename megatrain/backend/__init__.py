"""The backend protocol behind `megatrain.Accelerator`, and the MegaTrain engine's implementation of it.

Both faces hold one: the Accelerate face (`megatrain/accelerate/`) any of them, the DeepSpeed face
(`megatrain/deepspeed/`) the MegaTrain engine's. A face owns everything that is the same for every backend:
gradient accumulation bookkeeping, its wrappers, loss scaling by the accumulation steps, RNG and scheduler
checkpointing. A backend owns only what differs: how a model and optimizer become trainable, how a backward,
a clip and a step are done, and how weights are saved; what it can and cannot do is said by its class
attributes (below), never by the face testing its name. The comparison backends live in `baselines/` and
implement the same protocol without importing any of this package's engine.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import torch

from ..config.resolve import resolve
from ..config.schema import EngineConfig, EnginePlan, ResolvedConfig
from ..run import train_state
from .fused_head import serve_fused_lm_head, trl_head_options
from .placement import advice_for


@runtime_checkable
class Backend(Protocol):
    """What `megatrain.Accelerator` needs from a training stack."""

    name: str
    # What the stack can do; the faces read these instead of testing `name`.
    data_parallel: bool  # averages gradients over the ranks of a multi-process launch
    reads_engine_config: bool  # takes an `EngineConfig` (the others read DeepSpeed-style dicts only)
    supports_clip_value: bool  # clip_grad_value_ can clamp its accumulated gradients
    partitions_params: bool  # each rank holds a shard of every parameter (ZeRO-3): DeepSpeed owns the step
    fixed_accumulation_steps: bool  # the accumulation steps are fixed once built (in DeepSpeed's config)
    needs_autocast: bool  # bf16 means autocast around the script's forward (the others cast inside it)
    trains_many_models: bool  # more than one model per Accelerator
    main_process_writes: bool  # every rank holds the same state, so the main process saves it for all

    @property
    def device(self) -> torch.device:
        """Where batches should be placed."""
        ...

    def prepare(
        self, model: Any | None, optimizer: torch.optim.Optimizer | None, *, micro_batch_size: int | None = None
    ) -> tuple[Any, torch.optim.Optimizer | None]:
        """Make `model` trainable with `optimizer`; return (the model to call, the optimizer that
        actually updates the weights: the one LR schedulers must drive)."""
        ...

    def backward(self, loss: torch.Tensor, *, sync: bool) -> None:
        """Accumulate gradients of `loss` (already divided by the accumulation steps); `sync` says
        whether an optimizer step follows this micro-batch."""
        ...

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, norm_type: float = 2.0
    ) -> float | None:
        """Clip the accumulated gradients as `torch.nn.utils.clip_grad_norm_`; return the norm before."""
        ...

    def optimizer_step(self) -> None: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def step_was_skipped(self) -> bool: ...

    def unwrap_model(self, model: Any) -> Any: ...

    def get_state_dict(self, model: Any) -> dict[str, torch.Tensor]:
        """Every weight of the model, whole (gathered where the backend partitions them), by HF name."""
        ...

    def save_model(self, model: Any, directory: str | os.PathLike) -> None:
        """Write a Hugging Face checkpoint (config + safetensors) that `from_pretrained` loads."""
        ...

    def save_state(self, directory: str | os.PathLike) -> None:
        """Write weights and optimizer state (the face adds schedulers, RNG and counters)."""
        ...

    def load_state(self, directory: str | os.PathLike) -> None: ...


class MegatrainBackend:
    """The MegaTrain engine: host-resident FP32 masters and optimizer state, layers streamed."""

    name = "megatrain"
    data_parallel = True
    reads_engine_config = True
    supports_clip_value = True
    partitions_params = False
    fixed_accumulation_steps = False
    needs_autocast = False
    trains_many_models = False
    main_process_writes = True
    # MegaTrain's own engine: the faces write the run's start line for it (megatrain/run/start_line.py). Not in the
    # protocol: a backend without the attribute is not MegaTrain.
    says_what_runs = True

    def __init__(
        self,
        *,
        config: dict[str, Any] | EngineConfig | None = None,
        gradient_accumulation_steps: int = 1,
        mixed_precision: str | None = "no",
        gradient_checkpointing: bool = False,
        gradient_clipping: float = 0.0,
        cpu: bool = False,
    ) -> None:
        """`mixed_precision=None`: the compute dtype the config says (the DeepSpeed face's bf16 section). The
        settings are resolved by megatrain/config/resolve.py: here, unless a face hands over its own resolved."""
        if not isinstance(config, (ResolvedConfig, EnginePlan)):
            config = resolve(config, mixed_precision=mixed_precision, cpu=cpu).engine
        self.engine_config: EngineConfig = config
        # Gradient checkpointing needs no switch: the engine recomputes every layer in backward, which
        # is exactly the FLOPs of HF's per-layer checkpointing on the other backends.
        # The clip each step takes, handed to the engine when it is built (its `clipping` owns it from then on).
        self._clip_every_step = float(gradient_clipping)
        self.engine: Any = None
        self._optimizer_adopted = False
        self._skipped = False
        # What the engine steps instead of the optimizer it was given (DeepSpeedCPUAdam -> torch's AdamW), for
        # the run's start line; None: the optimizer given is the one stepped.
        self.replaced_optimizer: str | None = None
        # What prepare() turned off on the way to the engine (prepare_model), for the run's start line.
        self.turned_off: list[str] = []

    @property
    def device(self) -> torch.device:
        if self.engine is not None:
            return self.engine.device
        from ..engine import resolve_device

        return resolve_device(self.engine_config.device)

    def prepare(
        self, model: Any | None, optimizer: torch.optim.Optimizer | None, *, micro_batch_size: int | None = None
    ) -> tuple[Any, torch.optim.Optimizer | None]:
        if model is None:
            if optimizer is None:
                return None, None
            if self.engine is None:
                raise ValueError('backend "megatrain": prepare the model before (or together with) its optimizer')
            return None, self._adopt_optimizer(optimizer)
        if self.engine is not None:
            raise RuntimeError('backend "megatrain" drives one model per Accelerator; build another Accelerator')
        from ..engine import Engine

        optimizer = self.exact_optimizer(optimizer)
        # The engine settles its plan once (megatrain/config/settle.py settle_engine): an optimizer adopted by a later
        # prepare() steps whole (optimizer_later); a config's pin_memory is a habit, off without CUDA. What the plan
        # turns off is named first, before what the model's preparation turns off.
        first = len(self.turned_off)
        ec, finish = self.prepare_model(model, self.engine_config)
        self.engine = Engine(model, config=ec, optimizer=optimizer, clip_every_step=self._clip_every_step,
                             placement_advice=advice_for(self.device, model, ec),
                             optimizer_later=optimizer is None, pin_by_habit=True)
        self.turned_off[first:first] = self.engine.config.turned_off
        finish(self.engine)
        self._optimizer_adopted = optimizer is not None
        # The user's model object itself comes back: its parameters are the engine's host masters and its
        # forward runs the engine (megatrain/engine/model/model_object.py). The engine builds its own AdamW when
        # given none; hand that back only if the user gave one.
        # A PEFT model comes back as the PeftModel it was (engine/model/peft_model.py).
        model_out = self.engine.wrapper if self.engine.wrapper is not None else self.engine.module
        return model_out, (self.engine.optimizer if optimizer is not None else None)

    def prepare_model(self, model: Any, config: EngineConfig) -> tuple[EngineConfig, Any]:
        """What both faces do to a model before and after the engine takes it; returns (the engine config to
        build with, a function to call with the engine once built). What is turned off is added to `turned_off`.

        HF's gradient checkpointing (Trainer / TRL switch it on) is turned off: the engine recomputes each layer
        from its boundary activation already, and HF's own checkpoint would recompute again outside the engine's
        binding. TRL's fused-head patch is read off the forward before the engine replaces it, and served by the
        engine-run model after (backend/fused_head.py)."""
        if hf_checkpointing_on(model):
            hf_checkpointing_off(model)
            self.turned_off.append("HF gradient checkpointing (the engine recomputes each streamed layer itself)")
        head_options = trl_head_options(model)

        def finish(engine: Any) -> None:
            # the model the engine runs (a PEFT model's inner HF model, engine/model/peft_model.py)
            serve_fused_lm_head(engine.module, head_options, engine.head_chunk_tokens)

        return config, finish

    def _adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """prepare(model) then prepare(optimizer), as accelerate allows: the user's optimizer replaces the AdamW the
        engine built for itself, before any step (Engine.replace_optimizer)."""
        if self._optimizer_adopted:
            raise RuntimeError('backend "megatrain" drives one optimizer per model; it was prepared already')
        optimizer = self.exact_optimizer(optimizer)
        try:
            self.engine.replace_optimizer(optimizer)
        except (RuntimeError, ValueError) as e:
            raise type(e)(f'backend "megatrain": {e}') from e
        self._optimizer_adopted = True
        return optimizer

    def exact_optimizer(self, optimizer: Any) -> Any:
        """The optimizer the engine steps for `optimizer`: DeepSpeed's CPU Adam (accelerate builds it for an
        `offload_optimizer` config) as torch's AdamW over the same param groups (its own C++ op does not resume
        bit-identically, backend/exact_adam.py); anything else as it is. A replacement is noted for the start
        line (`replaced_optimizer`)."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            return optimizer
        from .exact_adam import exact_optimizer

        optimizer, what = exact_optimizer(optimizer)
        if what is not None:
            self.replaced_optimizer = what
        return optimizer

    def set_clipping(self, max_norm: float) -> None:
        """Clip by the global L2 norm `max_norm` at every optimizer step the script does not clip itself (0: off);
        what `gradient_clipping` set at construction, changed for a model handed over to training later."""
        if self.engine is None:
            self._clip_every_step = float(max_norm)  # checked by the engine's clipping when it is built
        else:
            self.engine.clipping.set_every_step(max_norm)

    @property
    def last_grad_norm(self) -> float | None:
        """The global norm before the last step's clip (None: that step was not clipped)."""
        return self.engine.clipping.last_norm if self.engine is not None else None

    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp the accumulated gradients in the host slabs (the masters' .grad are views of them)."""
        eng = self._require_engine()
        eng.synchronize()
        torch.nn.utils.clip_grad_value_([p for _, p in eng.named_parameters()], clip_value)
        eng.grads_written()  # no cached gradient norm holds any more

    def release(self) -> None:
        """Forget the engine (free_memory); its host store goes once the user drops the model too."""
        if self.engine is not None:
            self.engine.synchronize()
        self.engine = None
        self._optimizer_adopted = False

    def _require_engine(self) -> Any:
        if self.engine is None:
            raise RuntimeError('backend "megatrain": call prepare(model, optimizer) first')
        return self.engine

    def backward(self, loss: torch.Tensor, *, sync: bool) -> None:
        self._require_engine().backward(loss, sync=sync)

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, norm_type: float = 2.0
    ) -> float:
        if float(norm_type) != 2.0:
            raise ValueError('backend "megatrain" clips by the global L2 norm only (norm_type=2)')
        # torch's rule: the norm over the gradients of `parameters`, only theirs scaled. Every trainable parameter
        # among them (model.parameters()) is the engine's clip of its host slabs (a frozen parameter has no
        # gradient); a part of them is clipped as torch would, or refused by name where that cannot be exact.
        # The step then takes no clip of its own.
        params = [parameters] if torch.is_tensor(parameters) else list(parameters)
        return self._require_engine().clip_grad_norm_of(params, float(max_norm))

    def optimizer_step(self) -> None:
        # The engine clips by `gradient_clipping` unless the script did, and skips a step whose gradients are not
        # finite (DeepSpeed's fp16 overflow, counted the same way).
        self._skipped = self._require_engine().step() is False

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._require_engine().zero_grad()

    def synchronize(self) -> None:
        """Wait for the engine's queued work (copies, overlapped layer updates) before state is read."""
        self._require_engine().synchronize()

    def step_was_skipped(self) -> bool:
        return self._skipped

    def unwrap_model(self, model: Any) -> Any:
        return model  # prepare() handed back the user's model object itself

    def get_state_dict(self, model: Any) -> dict[str, torch.Tensor]:
        return self._require_engine().module.state_dict()

    def training_state(self, *, with_optimizer: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
        """(each distinct weight once by its HF name, the optimizer's state_dict) after queued updates landed.
        Every rank calls it: with a shared host store the optimizer state is gathered from the layers' owners."""
        eng = self._require_engine()
        eng.synchronize()
        optimizer_state = eng.optimizer.state_dict() if with_optimizer else None
        named = eng.ranks.whole(dict(eng.named_parameters()), eng.parts.layers_prefix)  # nodes sharing: gathered
        return {n: p.detach() for n, p in named.items()}, optimizer_state

    def load_training_state(self, weights: dict[str, torch.Tensor], optimizer_state: dict[str, Any] | None, *,
                            strict: bool = True) -> None:
        eng = self._require_engine()
        eng.load_state_dict(weights, strict=strict)
        eng.zero_grad()
        eng.synchronize()
        if optimizer_state is not None:
            eng.optimizer.load_state_dict(optimizer_state)

    def save_model(self, model: Any, directory: str | os.PathLike) -> None:
        # The model object's own save_pretrained: its state_dict is the FP32 masters, whole.
        self._require_engine().module.save_pretrained(str(directory))

    def save_state(self, directory: str | os.PathLike | None) -> None:
        """Write the weights and optimizer state; `directory` None: only this rank's part of a data-parallel save
        (with a shared host store the optimizer state is gathered from the layers' owners: a collective)."""
        eng = self._require_engine()
        mine = train_state.shard_params(eng)
        if mine is not None:  # one host store per node: each rank writes its layers' optimizer state, no gather
            weights, _ = self.training_state(with_optimizer=False)
            train_state.write_weights_sharded(directory, weights, eng.optimizer, mine, eng.dp.rank, eng.dp.group)
            return
        weights, optimizer_state = self.training_state()
        if directory is not None:
            train_state.write_weights(directory, weights, optimizer_state, residency=train_state.residency_record(eng))

    def load_state(self, directory: str | os.PathLike) -> None:
        eng = self._require_engine()
        # built before the folder was read: a run that placed another optimizer-resident count trains other bits
        differs = train_state.resumed_residency(eng, train_state.saved_residency(directory))
        if differs is not None:
            warnings.warn(differs, stacklevel=2)
        self.load_training_state(*train_state.read_weights(directory, eng))


def hf_checkpointing_on(model: Any) -> bool:
    """Whether HF's own activation checkpointing is on, asked by the name the installed transformers does not
    deprecate (transformers 5.25 renamed gradient_checkpointing to activation_checkpointing and warns on the old)."""
    new = getattr(type(model), "is_activation_checkpointing", None)
    return bool(getattr(model, "is_activation_checkpointing" if new is not None else "is_gradient_checkpointing",
                        False))


def hf_checkpointing_off(model: Any) -> None:
    off = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
    off()
