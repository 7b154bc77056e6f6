"""DeepSpeed ZeRO stage 3 with parameters and optimizer state offloaded to host memory.

This is the comparison point the MegaTrain paper measures against, run the way a Hugging Face user
runs it: the real `deepspeed` package driven through `accelerate.Accelerator(deepspeed_plugin=...)`.
It works on a CPU-only machine (DeepSpeed picks its CPU accelerator and gloo by itself) once the
single-process distributed environment is set, which `prepare_environment` does.
"""

from __future__ import annotations

import copy
import hashlib
import os
import socket
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

INSTALL_HINT = 'pip install "megatrain[deepspeed]"'
_CKPT_TAG = "zero3"


def require_deepspeed() -> Any:
    """Import deepspeed, or explain how to get it: it is an optional extra of this package."""
    try:
        import deepspeed
    except ImportError as exc:
        raise ImportError(
            f'backend "zero3" needs the DeepSpeed package, which is not installed: {INSTALL_HINT}'
        ) from exc
    return deepspeed


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_environment() -> None:
    """Make a plain `python train.py` behave like a one-process `accelerate launch`.

    Without the rendezvous variables DeepSpeed falls back to MPI discovery and fails on a missing
    mpi4py; its C++ ops are JIT-built with ninja, which pip installs next to the interpreter but
    not necessarily on PATH; a stable extensions dir makes the ~85 s build a once-per-machine cost.
    Values the user already set win.
    """
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(_free_port())
    bindir = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "")
    if bindir not in path.split(os.pathsep):
        os.environ["PATH"] = bindir + (os.pathsep + path if path else "")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", default_extensions_dir())
    _clear_stale_build_locks(Path(os.environ["TORCH_EXTENSIONS_DIR"]))


def default_extensions_dir() -> str:
    """Where DeepSpeed's JIT-built ops are cached: one directory per interpreter, since ops built against
    another venv's paths would be rebuilt (~85 s) on every switch between venvs."""
    prefix = hashlib.sha1(sys.prefix.encode()).hexdigest()[:10]
    return str(Path.home() / ".cache" / "megatrain" / "torch_extensions" / prefix)


def _clear_stale_build_locks(root: Path, max_age_s: float = 1200.0) -> None:
    """A JIT build killed mid-way (a timeout, Ctrl-C) leaves its `lock` file behind, and every later
    build of that op then waits on it forever. No build of these ops takes anywhere near `max_age_s`."""
    import time
    import warnings

    for lock in root.glob("*/lock"):
        try:
            age = time.time() - lock.stat().st_mtime
            if age > max_age_s:
                lock.unlink()
                warnings.warn(f"removed a stale DeepSpeed build lock {lock} ({age / 60:.0f} min old)", stacklevel=2)
        except OSError:
            continue


def build_ops() -> None:
    """JIT-build the DeepSpeed C++ ops ZeRO-3 CPU offload uses (cpu_adam, shm comm), once per machine."""
    require_deepspeed()
    prepare_environment()
    from deepspeed.ops.op_builder.cpu import CPUAdamBuilder, ShareMemCommBuilder

    for builder in (ShareMemCommBuilder(), CPUAdamBuilder()):
        builder.load(verbose=False)


# The ZeRO-3 offload settings Hugging Face documents for its DeepSpeed integration (the config its
# docs ship for ZeRO-3 with CPU offload, whose "auto" sizes Accelerate resolves from the model's
# hidden size exactly as below). DeepSpeed's bare defaults are sized for no model in particular
# (prefetch 5e7 elements, persistence 1e5, reduce bucket 5e8); these follow the model, so the
# baseline runs as its users are told to run it. A value the user sets wins.
OFFLOAD_TUNING: dict[str, Any] = {
    "overlap_comm": True,
    "contiguous_gradients": True,
    "sub_group_size": 1_000_000_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
}


def hidden_size_tuning(hidden_size: int) -> dict[str, int]:
    """The hidden-size-derived sizes of `OFFLOAD_TUNING` (Accelerate's resolution of "auto")."""
    if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size <= 0:
        raise ValueError(f"hidden_size must be a positive integer, got {hidden_size!r}")
    h = hidden_size
    return {
        "reduce_bucket_size": h * h,
        "stage3_prefetch_bucket_size": int(0.9 * h * h),
        "stage3_param_persistence_threshold": 10 * h,
    }


def _has_accelerator() -> bool:
    return torch.accelerator.current_accelerator(check_available=True) is not None


def build_ds_config(
    user: dict[str, Any] | None,
    *,
    gradient_accumulation_steps: int,
    mixed_precision: str,
    micro_batch_size: int | None,
    gradient_clipping: float = 0.0,
    hidden_size: int | None = None,
) -> dict[str, Any]:
    """The DeepSpeed config this backend runs: the user's, with ZeRO-3 CPU offload filled in.

    Unset (or "auto") bucket, prefetch and persistence sizes get the documented offload tuning
    (`OFFLOAD_TUNING`, `hidden_size_tuning`). Without `hidden_size` (a model with no HF config) the
    sizes are left as given: DeepSpeed's defaults, or "auto" for Accelerate to resolve.

    Pinned host buffers need an accelerator; on a CPU-only build `pin_memory=True` raises, so it
    defaults to whether one exists. Settings that are the face's business (accumulation, precision)
    are filled from the face, and a contradicting explicit value is an error rather than a guess.
    """
    cfg = copy.deepcopy(user or {})
    cfg.pop("megatrain", None)  # the MegaTrain engine's own section; DeepSpeed has no use for it
    zero = cfg.setdefault("zero_optimization", {})
    stage = zero.setdefault("stage", 3)
    if stage != 3:
        raise ValueError(f'backend "zero3" runs ZeRO stage 3, but the config asks for stage {stage!r}')
    pin = _has_accelerator()
    for section in ("offload_param", "offload_optimizer"):
        off = zero.setdefault(section, {})
        off.setdefault("device", "cpu")
        if off.get("pin_memory") in (None, "auto"):
            off["pin_memory"] = pin
        elif off["pin_memory"] and not pin:
            raise ValueError(f"zero_optimization.{section}.pin_memory=true needs an accelerator; this machine has none")
    for key, value in OFFLOAD_TUNING.items():
        zero.setdefault(key, value)
    sized = hidden_size_tuning(hidden_size) if hidden_size is not None else {}
    for key in ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
        if zero.get(key, "auto") == "auto" and key in sized:
            zero[key] = sized[key]

    gas = cfg.get("gradient_accumulation_steps", "auto")
    if gas not in ("auto", gradient_accumulation_steps):
        raise ValueError(
            f"the DeepSpeed config says gradient_accumulation_steps={gas!r} but the Accelerator was built with "
            f"{gradient_accumulation_steps}; set one of them"
        )
    cfg["gradient_accumulation_steps"] = gradient_accumulation_steps

    # The face resolves the config's clipping once for every backend (DeepSpeed's default of 1.0
    # included); clipping asked for through clip_grad_norm_ overrides it step by step.
    cfg["gradient_clipping"] = float(gradient_clipping)

    bf16 = mixed_precision == "bf16"
    for key, want in (("bf16", bf16), ("fp16", False)):
        section = cfg.setdefault(key, {})
        if section.get("enabled", "auto") == "auto":
            section["enabled"] = want
        elif section["enabled"] != want:
            raise ValueError(
                f'the DeepSpeed config has {key}.enabled={section["enabled"]!r} but mixed_precision={mixed_precision!r}'
            )

    mb = cfg.get("train_micro_batch_size_per_gpu", "auto")
    if mb == "auto":
        mb = micro_batch_size or 1  # only DeepSpeed's sample accounting reads it
        cfg["train_micro_batch_size_per_gpu"] = mb
    if cfg.get("train_batch_size", "auto") == "auto":
        # DeepSpeed checks it against every data-parallel rank's share (prepare_environment set WORLD_SIZE).
        cfg["train_batch_size"] = mb * gradient_accumulation_steps * int(os.environ.get("WORLD_SIZE", "1"))
    cfg.setdefault("zero_allow_untested_optimizer", True)
    cfg.setdefault("wall_clock_breakdown", False)
    return cfg


def _hidden_size(model: torch.nn.Module) -> int | None:
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    return hidden if isinstance(hidden, int) and not isinstance(hidden, bool) and hidden > 0 else None


def _check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    # Accelerate maps any torch optimizer to DeepSpeedCPUAdam when the optimizer is offloaded, so an
    # SGD would silently train as Adam; only what DeepSpeedCPUAdam computes is accepted.
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise TypeError(
            f'backend "zero3" offloads the optimizer to DeepSpeedCPUAdam, which can stand in for torch.optim.Adam '
            f"or AdamW only, not {type(optimizer).__name__}"
        )
    for group in optimizer.param_groups:
        for flag in ("amsgrad", "maximize"):
            if group.get(flag):
                raise ValueError(f'backend "zero3": DeepSpeedCPUAdam has no {flag}=True')


class Zero3Backend:
    """One DeepSpeed ZeRO-3 offload engine, built by Accelerate at `prepare` time.

    Accelerate's own loop runs `engine.step()` inside `backward()` at a sync step, which leaves no
    point at which a user's `clip_grad_norm_` could still act. This backend keeps the same engine
    calls but defers `engine.step()` to the optimizer's `step()`, so clipping requested between
    backward and step is applied by DeepSpeed's own clipping in that step.

    As under Accelerate, once prepared, transformers sees ZeRO-3 as enabled for the rest of the
    process: an HF model built afterwards in the same process (say, a reload of a saved checkpoint)
    is constructed partitioned. Reload saved models in another process.
    """

    name = "zero3"
    # What the face may rely on (megatrain.backend.Backend). The gradients live partitioned in DeepSpeed's
    # offload buffers, where torch's clamp cannot reach them; DeepSpeed fixes the accumulation steps in its config.
    data_parallel = True
    reads_engine_config = False
    supports_clip_value = False
    partitions_params = True
    fixed_accumulation_steps = True
    needs_autocast = False
    trains_many_models = False
    main_process_writes = False

    def __init__(
        self,
        *,
        config: dict[str, Any] | None = None,
        gradient_accumulation_steps: int = 1,
        mixed_precision: str = "no",
        gradient_checkpointing: bool = False,
        gradient_clipping: float = 0.0,
        cpu: bool = False,
    ) -> None:
        require_deepspeed()
        if cpu and torch.cuda.is_available():
            raise ValueError(f"cpu=True with backend {self.name!r}: DeepSpeed picks its accelerator itself; run with "
                             "DS_ACCELERATOR=cpu and CUDA_VISIBLE_DEVICES='' instead")
        if config is not None and not isinstance(config, dict):
            raise TypeError(f'backend "zero3" takes a DeepSpeed config dict, not {type(config).__name__}')
        self._user_config = config
        self._gas = gradient_accumulation_steps
        self._mixed_precision = mixed_precision
        self._gradient_checkpointing = gradient_checkpointing
        self._gradient_clipping = float(gradient_clipping)
        self.ds_config: dict[str, Any] | None = None
        self.accelerate: Any = None  # the accelerate.Accelerator that built the engine
        self.engine: Any = None
        self._clip: float | None = None

    @property
    def device(self) -> torch.device:
        if self.engine is not None:
            return self.engine.device
        return torch.accelerator.current_accelerator(check_available=True) or torch.device("cpu")

    def prepare(
        self,
        model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        *,
        micro_batch_size: int | None = None,
    ) -> tuple[Any, torch.optim.Optimizer | None]:
        if model is None:
            if optimizer is not None:
                raise ValueError('backend "zero3": pass the model and its optimizer to the same prepare() call')
            return None, None
        if self.engine is not None:
            raise RuntimeError('backend "zero3" drives one model per Accelerator; build another Accelerator')
        if optimizer is not None:
            _check_optimizer(optimizer)
        prepare_environment()
        from accelerate import Accelerator as HFAccelerator
        from accelerate.utils import DeepSpeedPlugin

        if self._gradient_checkpointing:
            model.gradient_checkpointing_enable()
        self.ds_config = build_ds_config(
            self._user_config,
            gradient_accumulation_steps=self._gas,
            mixed_precision=self._mixed_precision,
            micro_batch_size=micro_batch_size,
            gradient_clipping=self._gradient_clipping,
            hidden_size=_hidden_size(model),
        )
        plugin = DeepSpeedPlugin(hf_ds_config=self.ds_config)
        self.accelerate = HFAccelerator(
            deepspeed_plugin=plugin,
            mixed_precision=self._mixed_precision,
            gradient_accumulation_steps=self._gas,
        )
        if optimizer is None:
            engine = self.accelerate.prepare(model)
            ds_opt = None
        else:
            engine, wrapped = self.accelerate.prepare(model, optimizer)
            ds_opt = wrapped.optimizer  # DeepSpeed's ZeRO-3 optimizer; its param_groups are the CPU Adam's
        self.engine = engine
        return engine, ds_opt

    def _require_engine(self) -> Any:
        if self.engine is None:
            raise RuntimeError('backend "zero3": call prepare(model, optimizer) first')
        return self.engine

    def backward(self, loss: torch.Tensor, *, sync: bool) -> None:
        engine = self._require_engine()
        engine.set_gradient_accumulation_boundary(is_boundary=sync)
        # The face has already divided by the accumulation steps, as it does for every backend.
        engine.backward(loss, scale_wrt_gas=False)

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, norm_type: float = 2.0
    ) -> float | None:
        """Arrange for DeepSpeed to clip at the next step; return the current total norm.

        The gradients live partitioned in DeepSpeed's offload buffers, so `parameters` cannot be
        clipped in place: DeepSpeed's step does it with the same formula as torch. The norm comes
        from the ZeRO-3 optimizer's own reduction and is None if this DeepSpeed lacks it.
        """
        engine = self._require_engine()
        if float(norm_type) != 2.0:
            raise ValueError('backend "zero3": DeepSpeed clips by the L2 norm only (norm_type=2)')
        self._clip = float(max_norm)
        if not engine.is_gradient_accumulation_boundary():
            return None  # mid-accumulation the partitioned gradients are not reduced yet: no norm to report
        opt = engine.optimizer
        try:
            from deepspeed.runtime.utils import combine_grad_norm_groups

            norm = combine_grad_norm_groups(opt._get_norm_groups()) / opt.loss_scale
        except (AttributeError, ImportError):
            return None
        return float(norm)

    def optimizer_step(self) -> None:
        engine = self._require_engine()
        opt = engine.optimizer
        configured = float(self.ds_config.get("gradient_clipping") or 0.0)
        if self._clip is not None:
            opt.clip_grad = self._clip
        else:
            opt.clip_grad = configured
        try:
            engine.step()
        finally:
            self._clip = None
            opt.clip_grad = configured

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass  # DeepSpeed's engine.step() zeroes the partitioned gradients itself

    def step_was_skipped(self) -> bool:
        return bool(getattr(self._require_engine().optimizer, "overflow", False))

    def unwrap_model(self, model: Any) -> torch.nn.Module:
        return getattr(model, "module", model)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Gather the partitioned parameters into one full CPU state dict (HF names)."""
        import deepspeed

        module = self._require_engine().module
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}

    def get_state_dict(self, model: Any) -> dict[str, torch.Tensor]:
        return self.full_state_dict()

    def save_model(self, model: Any, directory: str | os.PathLike) -> None:
        module = self.unwrap_model(model)
        state = self.full_state_dict()
        module.save_pretrained(str(directory), state_dict=state)

    def save_state(self, directory: str | os.PathLike) -> None:
        self._require_engine().save_checkpoint(str(directory), tag=_CKPT_TAG)

    def load_state(self, directory: str | os.PathLike) -> None:
        path, _ = self._require_engine().load_checkpoint(str(directory), tag=_CKPT_TAG)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint (tag {_CKPT_TAG!r}) under {directory}")


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="DeepSpeed ZeRO-3 CPU-offload baseline utilities")
    ap.add_argument("--build-ops", action="store_true", help="JIT-build DeepSpeed's C++ ops now (~85 s once)")
    if ap.parse_args().build_ops:
        build_ops()
        print(f"DeepSpeed ops built in {os.environ['TORCH_EXTENSIONS_DIR']}")
