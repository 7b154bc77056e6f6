"""What transformers and accelerate read about the ZeRO stage, for a DeepSpeed config with a "megatrain" section:
nothing is partitioned on MegaTrain, whatever stage the config names.

This half of the routing needs accelerate only, not the deepspeed package: transformers asks
`HfDeepSpeedConfig.is_zero3()` (through `is_deepspeed_zero3_enabled()`) when it builds a model, before anything
imports deepspeed. Installed when `deepspeed` is first imported, as the rest of the routing (`hf.py`), it came too
late for that question: `from_pretrained` under `python run_clm.py` logged "Detected DeepSpeed ZeRO-3: activating
zero.init() for this model" and entered a `zero.Init` that the routing then made a no-op. So `megatrain/_startup.py`
installs this module as soon as `accelerate.utils.deepspeed` (where `HfDeepSpeedConfig` lives) is imported.
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
from typing import Any

__all__ = ["install", "uninstall", "installed", "has_megatrain_section"]

_SECTION = "megatrain"
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


def install() -> None:
    """Make `HfDeepSpeedConfig.is_zero3()` false and accelerate's `DeepSpeedPlugin` read stage 3 as 2 for a config
    with the section (idempotent; needs accelerate)."""
    if _saved:
        return
    from accelerate.utils.dataclasses import DeepSpeedPlugin
    from accelerate.utils.deepspeed import HfDeepSpeedConfig

    real_is_zero3 = HfDeepSpeedConfig.is_zero3
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
        return False if has_megatrain_section(self.config) else real_is_zero3(self)

    @functools.wraps(real_plugin_post_init)
    def plugin_post_init(self: Any) -> None:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            real_plugin_post_init(self)
        ours = has_megatrain_section(self.hf_ds_config)
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
        if not has_megatrain_section(self.hf_ds_config):
            return
        if self.zero_stage == 3:
            self.zero_stage = 2
        # From here on accelerate and TRL expect a process group (TRL's DPO broadcasts before any engine exists).
        one_rank_group()

    logging.getLogger("accelerate.accelerator").addFilter(_NOTE)
    _saved.update(is_zero3=real_is_zero3, plugin_post_init=real_plugin_post_init, config_process=real_process)
    HfDeepSpeedConfig.is_zero3 = is_zero3
    DeepSpeedPlugin.__post_init__ = plugin_post_init
    DeepSpeedPlugin.deepspeed_config_process = config_process


def uninstall() -> None:
    """Undo `install()`."""
    if not _saved:
        return
    from accelerate.utils.dataclasses import DeepSpeedPlugin
    from accelerate.utils.deepspeed import HfDeepSpeedConfig

    logging.getLogger("accelerate.accelerator").removeFilter(_NOTE)
    _ours_seen.clear()
    HfDeepSpeedConfig.is_zero3 = _saved.pop("is_zero3")
    DeepSpeedPlugin.__post_init__ = _saved.pop("plugin_post_init")
    DeepSpeedPlugin.deepspeed_config_process = _saved.pop("config_process")


def installed() -> bool:
    return bool(_saved)


install()
