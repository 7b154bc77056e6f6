"""`import megatrain.integrations.hf`: Trainer / TRL runs whose DeepSpeed config has a "megatrain" section train
on MegaTrain; every other DeepSpeed config still runs on real DeepSpeed.

Hugging Face `Trainer` (and TRL's trainers, which subclass it) reach DeepSpeed through accelerate, which calls
`deepspeed.initialize(...)`. Importing this module replaces that one function with a dispatcher: a config
holding a "megatrain" section goes to `megatrain.initialize` (same arguments, same four results), anything
else to DeepSpeed's own; `deepspeed.zero.Init` (which transformers enters to build a model at stage 3) is
a no-op for such a config and transformers' `is_deepspeed_zero3_enabled()` is false for it, since MegaTrain
partitions nothing: it takes the whole model over itself. It also makes DeepSpeed's config parser refuse a "megatrain" section, so a config
that reaches real DeepSpeed by any other road (its own `initialize` kept from before the import,
`init_inference`, a hand-built engine) is an error instead of a run that silently ignores the section.

The script need not import it: an installed megatrain loads it right after the process's first `import deepspeed`
(`megatrain/_startup.py`, run at start-up by the package's `.pth` file; MEGATRAIN_DEEPSPEED_GUARD=0 opts out), and
`megatrain launch script.py` installs it in every process before the script runs. For such a config accelerate's
`DeepSpeedPlugin` reads ZeRO stage 3 as 2 (TRL asks it whether parameters are partitioned) and sets up the one-rank
process group a launcher-less run needs (`hf_stage.py`: that half needs accelerate only and is installed earlier, at
accelerate's import, before transformers first asks whether ZeRO-3 is on); a model initialized forward-only and
then to train keeps one engine (`engine_reuse.py`).
"""

from __future__ import annotations

import functools
from typing import Any

from ..run import start_line
from . import hf_stage
from .hf_stage import has_megatrain_section

__all__ = ["install", "uninstall", "installed", "has_megatrain_section", "MegaTrainSectionError"]

_saved: dict[str, Any] = {}


class MegaTrainSectionError(ValueError):
    """A DeepSpeed config with a "megatrain" section reached real DeepSpeed, which would ignore it."""


def _route_config(args: Any, kwargs: dict[str, Any]) -> Any:
    for key in ("config", "config_params"):
        if kwargs.get(key) is not None:
            return kwargs[key]
    return getattr(args, "deepspeed_config", None) if args is not None else None


def _refusal(where: str) -> MegaTrainSectionError:
    return MegaTrainSectionError(
        f"this DeepSpeed config has a 'megatrain' section but reached real DeepSpeed ({where}), which would "
        "train without MegaTrain and ignore the section. Run the script with `megatrain launch script.py ...`, "
        "or call megatrain.initialize (or `import megatrain as deepspeed`), or `import megatrain.integrations.hf` "
        "before building the Trainer / Accelerator; "
        "to train on DeepSpeed, remove the 'megatrain' section")


def install() -> None:
    """Route `deepspeed.initialize` by config and make DeepSpeed's config parser refuse a "megatrain" section.

    Idempotent. Needs the `deepspeed` package (Trainer's DeepSpeed path needs it anyway).
    """
    if _saved:
        return
    try:
        import deepspeed
        from deepspeed.runtime.config import DeepSpeedConfig
    except ImportError as e:
        raise ImportError("megatrain.integrations.hf routes Trainer's DeepSpeed path, which needs the deepspeed "
                          "package: pip install 'megatrain[deepspeed]'") from e

    real_initialize = deepspeed.initialize
    real_config_init = DeepSpeedConfig.__init__
    real_zero_init = deepspeed.zero.Init

    @functools.wraps(real_initialize)
    def initialize(args: Any = None, *rest: Any, **kwargs: Any) -> Any:
        if has_megatrain_section(_route_config(args, kwargs)):
            from ..deepspeed.initializer import initialize as mt_initialize
            from .engine_reuse import initialize_once

            hf_stage.one_rank_group()
            with start_line.via("deepspeed.initialize (HF Trainer / accelerate)"):
                return initialize_once(mt_initialize, args, rest, kwargs)
        return real_initialize(args, *rest, **kwargs)

    def zero_init(*args: Any, **kwargs: Any) -> Any:
        # transformers builds models under deepspeed.zero.Init when the config says stage 3; MegaTrain wants the
        # model whole on the host (it takes the storage over itself), so a MegaTrain config gets a no-op context.
        config = kwargs.get("config_dict_or_path", kwargs.get("config"))
        if has_megatrain_section(config):
            from ..deepspeed import zero as mt_zero

            return mt_zero.Init(*args, **kwargs)
        return real_zero_init(*args, **kwargs)

    @functools.wraps(real_config_init)
    def config_init(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        if has_megatrain_section(config):
            raise _refusal("deepspeed.runtime.config.DeepSpeedConfig")
        real_config_init(self, config, *args, **kwargs)

    # What transformers and accelerate read about the stage (usually installed already, at accelerate's import).
    hf_stage.install()
    _saved.update(initialize=real_initialize, config_init=real_config_init, zero_init=real_zero_init)
    deepspeed.initialize = initialize
    deepspeed.zero.Init = zero_init
    DeepSpeedConfig.__init__ = config_init


def uninstall() -> None:
    """Undo `install()` (tests; a process that wants real DeepSpeed only again)."""
    if not _saved:
        return
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig

    deepspeed.initialize = _saved.pop("initialize")
    deepspeed.zero.Init = _saved.pop("zero_init")
    DeepSpeedConfig.__init__ = _saved.pop("config_init")
    hf_stage.uninstall()


def installed() -> bool:
    return bool(_saved)


install()
