"""What transformers and accelerate read about the ZeRO stage, for a DeepSpeed config with a "megatrain" section:
nothing is partitioned on MegaTrain, whatever stage the config names.

This half of the routing needs accelerate only, not the deepspeed package: transformers asks
`HfDeepSpeedConfig.is_zero3()` (through `is_deepspeed_zero3_enabled()`) when it builds a model, before anything
imports deepspeed. Installed when `deepspeed` is first imported, as the rest of the routing (`hf.py`), it came too
late for that question: `from_pretrained` under `python run_clm.py` logged "Detected DeepSpeed ZeRO-3: activating
zero.init() for this model" and entered a `zero.Init` that the routing then made a no-op. So `megatrain/_startup.py`
installs this module as soon as `accelerate.utils.deepspeed` (where `HfDeepSpeedConfig` lives) is imported.

It also gives accelerate's state the launch's ranks on the DeepSpeed road of a machine without an accelerator
(`complete_cpu_state`), where accelerate records one process of a group of many.
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
from typing import Any

from ..files import env

__all__ = ["install", "uninstall", "installed", "has_megatrain_section", "routed", "LAUNCHED_ENV",
           "unwrap_engines", "complete_cpu_state"]

_SECTION = "megatrain"
# Set by `megatrain launch` in every process it starts: there every DeepSpeed config trains on MegaTrain, "megatrain"
# section or not (the user chose MegaTrain by the command).
LAUNCHED_ENV = env.LAUNCHED
_saved: dict[str, Any] = {}


def _config_dict(config: Any) -> dict[str, Any] | None:
    if isinstance(config, dict):
        return config
    if config is not None and hasattr(config, "config") and isinstance(config.config, dict):
        return config.config  # transformers' HfDeepSpeedConfig
    if isinstance(config, (str, os.PathLike)) and os.path.isfile(config):
        from ..config.deepspeed import load_config_dict

        return load_config_dict(config)
    return None


def has_megatrain_section(config: Any) -> bool:
    """Whether a DeepSpeed config (dict, JSON/hjson path or HfDeepSpeedConfig) carries a "megatrain" section."""
    d = _config_dict(config)
    return d is not None and _SECTION in d


def launched() -> bool:
    """Whether this process runs under `megatrain launch` (and the user did not leave DeepSpeed on DeepSpeed)."""
    return env.launched() and not env.deepspeed_left_alone()


def deepspeed_is_megatrain() -> bool:
    """Whether the name `deepspeed` is MegaTrain's namespace (every deepspeed import redirected to it by a shim
    package, `megatrain/deepspeed/redirect.py`): then no config can reach real DeepSpeed."""
    import sys

    module = sys.modules.get("deepspeed")
    return module is not None and getattr(module, "__name__", "").startswith("megatrain")


def routed(config: Any) -> bool:
    """Whether a DeepSpeed config trains on MegaTrain: it has a "megatrain" section, or the process runs under
    `megatrain launch`, or `deepspeed` is MegaTrain's namespace."""
    return has_megatrain_section(config) or launched() or deepspeed_is_megatrain()


def one_rank_group() -> None:
    """A one-rank process group for a plain `python script.py` (no launcher variables), where Trainer and
    accelerate expect one once DeepSpeed is configured (Trainer's `nested_gather` at the first logging step).
    An in-memory store: nothing listens on a port."""
    import torch.distributed as dist

    if dist.is_available() and not dist.is_initialized() and "WORLD_SIZE" not in os.environ:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


class _AccumulationNote(logging.Filter):
    """Drops accelerate's "Gradient accumulation steps mismatch" for a config with the "megatrain" section: Trainer
    leaves accelerate's own plugin at 1 under DeepSpeed and accelerate takes the config's value, which MegaTrain's
    parser filled from the same TrainingArguments, so the note reports no disagreement the user made."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (_ours_seen and "Gradient accumulation steps mismatch" in record.getMessage())


_ours_seen: list[bool] = []  # non-empty once a DeepSpeedPlugin for a "megatrain" config was built
_NOTE = _AccumulationNote()


def complete_cpu_state(state: Any) -> None:
    """Give accelerate's state the launch's ranks on the DeepSpeed road of a machine without an accelerator.

    There accelerate finds no device backend, lets DeepSpeed's `init_distributed` make the launch's process group
    (every rank of it) and then, its own backend being None, records one process: each rank filled
    train_batch_size as micro x accumulation x 1 (4 where MegaTrain's parser, counting the group's 2 ranks, asks 8),
    and every rank loaded every batch. Only for a config that trains on MegaTrain (real DeepSpeed is left as
    accelerate leaves it); the ranks, rank and backend are the process group's own."""
    import torch.distributed as dist
    from accelerate.utils import DistributedType

    if state.__dict__.get("backend", "") is not None or state.__dict__.get("distributed_type") != \
            DistributedType.DEEPSPEED:
        return
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    if not (_ours_seen or routed(os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"))):
        return
    state.backend = dist.get_backend()
    state.num_processes = dist.get_world_size()
    state.process_index = dist.get_rank()
    state.local_process_index = int(os.environ.get("LOCAL_RANK", dist.get_rank()))


def install() -> None:
    """Make `HfDeepSpeedConfig.is_zero3()` false and accelerate's `DeepSpeedPlugin` read stage 3 as 2 for a config
    with the section (idempotent; without accelerate there is nothing to install)."""
    import importlib.util

    if _saved or importlib.util.find_spec("accelerate") is None:
        return
    from accelerate.state import PartialState
    from accelerate.utils.dataclasses import DeepSpeedPlugin
    from accelerate.utils.deepspeed import HfDeepSpeedConfig

    real_is_zero3 = HfDeepSpeedConfig.is_zero3
    real_state_init = PartialState.__init__
    real_plugin_post_init = DeepSpeedPlugin.__post_init__
    real_process = DeepSpeedPlugin.deepspeed_config_process

    @functools.wraps(real_process)
    def config_process(self: Any, prefix: str = "", mismatches: Any = None, config: Any = None, must_match: bool = True,
                       **kwargs: Any) -> Any:
        # accelerate fills every "auto" of the config from Trainer's values and refuses one it has no value for;
        # the "megatrain" section's "auto" (host_master, residency, compute_dtype, ...) is MegaTrain's to resolve
        if prefix == "megatrain." or prefix.startswith("megatrain."):
            return None
        return real_process(self, prefix=prefix, mismatches=mismatches, config=config, must_match=must_match,
                            **kwargs)

    @functools.wraps(real_is_zero3)
    def is_zero3(self: Any) -> bool:
        # transformers asks this (is_deepspeed_zero3_enabled) before building, initialising, loading or generating
        # with a partitioned model; under MegaTrain nothing is partitioned, whatever stage the config names.
        if not real_is_zero3(self):
            return False
        if routed(self.config):
            return False
        # A stage-3 config asked about before anything imported deepspeed: a shim answering the name (every
        # deepspeed import redirected to MegaTrain) builds nothing partitioned either. Importing deepspeed here
        # costs nothing extra: transformers imports it next for ZeRO-3 construction.
        import importlib.util

        if importlib.util.find_spec("deepspeed") is not None:
            import deepspeed  # noqa: F401
        return not deepspeed_is_megatrain()

    @functools.wraps(real_plugin_post_init)
    def plugin_post_init(self: Any) -> None:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            real_plugin_post_init(self)
        ours = routed(self.hf_ds_config)
        if ours and not _ours_seen:
            _ours_seen.append(True)
        for w in said:
            # the stage-3 init flag (axolotl sets ACCELERATE_DEEPSPEED_ZERO3_INIT for a stage-3 config) meets the
            # stage-2 reading below: accelerate's warning names a stage the user did not set, and nothing is
            # partitioned at init under MegaTrain either, so it is not passed on
            if not (ours and "Zero3 Init flag is only applicable" in str(w.message)):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        # accelerate's plugin is what TRL and Trainer ask whether ZeRO-3 is on (`deepspeed_plugin.zero_stage == 3`)
        # before gathering partitioned parameters or removing ZeRO-3's hooks for generation: an engine that has
        # neither would be asked for them. MegaTrain keeps every parameter whole, so a stage-3 config reads as 2,
        # the highest stage whose contract (whole parameters, no `no_sync`) holds; the config itself is unchanged.
        if not ours:
            return
        if self.zero_stage == 3:
            self.zero_stage = 2
        # From here on accelerate and TRL expect a process group (TRL's DPO broadcasts before any engine exists).
        one_rank_group()

    @functools.wraps(real_state_init)
    def state_init(self: Any, *args: Any, **kwargs: Any) -> None:
        real_state_init(self, *args, **kwargs)
        complete_cpu_state(self)  # before AcceleratorState copies the shared state

    logging.getLogger("accelerate.accelerator").addFilter(_NOTE)
    unwrap_engines()
    _saved.update(is_zero3=real_is_zero3, plugin_post_init=real_plugin_post_init, config_process=real_process,
                  state_init=real_state_init)
    PartialState.__init__ = state_init
    HfDeepSpeedConfig.is_zero3 = is_zero3
    DeepSpeedPlugin.__post_init__ = plugin_post_init
    DeepSpeedPlugin.deepspeed_config_process = config_process


def uninstall() -> None:
    """Undo `install()`."""
    if not _saved:
        return
    from accelerate.state import PartialState
    from accelerate.utils.dataclasses import DeepSpeedPlugin
    from accelerate.utils.deepspeed import HfDeepSpeedConfig

    logging.getLogger("accelerate.accelerator").removeFilter(_NOTE)
    PartialState.__init__ = _saved.pop("state_init")
    _ours_seen.clear()
    _restore_unwrap()
    HfDeepSpeedConfig.is_zero3 = _saved.pop("is_zero3")
    DeepSpeedPlugin.__post_init__ = _saved.pop("plugin_post_init")
    DeepSpeedPlugin.deepspeed_config_process = _saved.pop("config_process")


# Where accelerate's `extract_model_from_parallel` is held by name (module globals): accelerate's Accelerator
# (unwrap_model, get_state_dict, save_model) and transformers' `unwrap_model` call it from there.
_UNWRAP_HOLDERS = ("accelerate.utils.other", "accelerate.utils", "accelerate.accelerator", "transformers.modeling_utils")
_real_unwrap: list[Any] = []


def unwrap_engines() -> None:
    """Make accelerate's `extract_model_from_parallel` unwrap MegaTrain's engine to the user's model.

    accelerate unwraps a DeepSpeed engine by `isinstance(model, deepspeed.DeepSpeedEngine)`; MegaTrain's engine is
    not one, so `accelerator.unwrap_model(engine)` handed back the engine and the user's final
    `unwrap_model(model).save_pretrained(..., is_main_process=...)` failed. Idempotent; called again once a
    MegaTrain engine exists (modules imported after the first call hold the original by name)."""
    import sys

    from accelerate.utils import other

    real = _real_unwrap[0] if _real_unwrap else other.extract_model_from_parallel
    if not _real_unwrap:
        _real_unwrap.append(real)

        @functools.wraps(real)
        def extract_model_from_parallel(model: Any, *args: Any, **kwargs: Any) -> Any:
            engine_module = _engine_module(model)
            return real(engine_module if engine_module is not None else model, *args, **kwargs)

        _real_unwrap.append(extract_model_from_parallel)
    ours = _real_unwrap[1]
    for name in _UNWRAP_HOLDERS:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "extract_model_from_parallel", None) is real:
            module.extract_model_from_parallel = ours


def _engine_module(model: Any) -> Any:
    """The user's model inside a MegaTrain engine (the `deepspeed.initialize` look-alike's), else None."""
    import sys

    engine_cls = getattr(sys.modules.get("megatrain.deepspeed.deepspeed_engine"), "MegaTrainEngine", None)
    return model.module if engine_cls is not None and isinstance(model, engine_cls) else None


def _restore_unwrap() -> None:
    import sys

    if not _real_unwrap:
        return
    real, ours = _real_unwrap
    for name in _UNWRAP_HOLDERS:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "extract_model_from_parallel", None) is ours:
            module.extract_model_from_parallel = real
    _real_unwrap.clear()


def installed() -> bool:
    return bool(_saved)


install()
