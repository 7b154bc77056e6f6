"""`import megatrain.integrations.hf`: which engine a `deepspeed.initialize` call trains on.

Hugging Face `Trainer` (and TRL's trainers, which subclass it) reach DeepSpeed through accelerate, which calls
`deepspeed.initialize(...)`; a DeepSpeed script calls it itself. Importing this module replaces that one function
with a dispatcher: a config goes to `megatrain.initialize` (same arguments, same four results) when it holds a
"megatrain" section, or when the process runs under `megatrain launch` (whatever the config: the user chose
MegaTrain by the command); anything else goes to DeepSpeed's own, which then says so on a start line of its own
(`on_deepspeed.py`). `deepspeed.zero.Init` (which transformers enters to build a model at stage 3) is a no-op for a
routed config and transformers' `is_deepspeed_zero3_enabled()` is false for it, since MegaTrain partitions nothing:
it takes the whole model over itself. It also makes DeepSpeed's config parser refuse a "megatrain" section, so a
config that reaches real DeepSpeed by any other road (its own `initialize` kept from before the import,
`init_inference`, a hand-built engine) is an error instead of a run that silently ignores the section.

The script need not import it: an installed megatrain loads it right after the process's first `import deepspeed`
(`megatrain/_startup.py`, run at start-up by the package's `.pth` file), and `megatrain launch script.py` installs it
in every process before the script runs. MEGATRAIN_DEEPSPEED_GUARD=0 leaves DeepSpeed untouched (the run's start
line says so). Where every `deepspeed` import is redirected to MegaTrain's namespace (a shim package,
`megatrain/deepspeed/redirect.py`) there is no real DeepSpeed to route and this installs only the half below. For a
routed config accelerate's `DeepSpeedPlugin` reads ZeRO stage 3 as 2 (TRL asks it whether parameters are
partitioned), sets up the one-rank process group a launcher-less run needs and unwraps MegaTrain's engine to the
user's model (`hf_stage.py`: that half needs accelerate only and is installed earlier, at accelerate's import,
before transformers first asks whether ZeRO-3 is on); a model initialized forward-only and then to train keeps one
engine (`engine_reuse.py`).
"""
from __future__ import annotations

import functools
from typing import Any

from ..run import start_line
from . import hf_stage, on_deepspeed, resume_residency
from .hf_stage import has_megatrain_section, routed

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
    resume_residency.install_if_loaded()  # a Trainer resume places its checkpoint's residency (resume_residency.py)
    if _saved:
        return
    try:
        import deepspeed
    except ImportError as e:
        raise ImportError("megatrain.integrations.hf routes Trainer's DeepSpeed path, which needs the deepspeed "
                          "package: pip install 'megatrain[deepspeed]'") from e
    if hf_stage.deepspeed_is_megatrain():
        # Every deepspeed import is redirected to MegaTrain's namespace (a shim package): nothing can reach real
        # DeepSpeed, so there is nothing to route. What transformers and accelerate read still needs its half.
        hf_stage.install()
        return
    try:
        from deepspeed.runtime.config import DeepSpeedConfig
    except ImportError as e:
        raise ImportError("megatrain.integrations.hf routes Trainer's DeepSpeed path, which needs the deepspeed "
                          "package: pip install 'megatrain[deepspeed]'") from e

    real_initialize = deepspeed.initialize
    real_config_init = DeepSpeedConfig.__init__
    real_zero_init = deepspeed.zero.Init
    real_init_distributed = deepspeed.comm.init_distributed

    @functools.wraps(real_init_distributed)
    def init_distributed(*args: Any, **kwargs: Any) -> Any:
        # `megatrain launch script.py` runs one process with no launcher variables, as `python script.py`; DeepSpeed's
        # init_distributed would then look for MPI. There it gets torchrun's one-rank variables, as under
        # `deepspeed script.py` (which sets them), and makes its process group from them.
        import os

        import torch.distributed as dist

        if hf_stage.launched() and "RANK" not in os.environ and not (dist.is_available() and dist.is_initialized()):
            from ..commands.launch_command import one_rank_env

            os.environ.update(one_rank_env(os.environ))
        return real_init_distributed(*args, **kwargs)

    @functools.wraps(real_initialize)
    def initialize(args: Any = None, *rest: Any, **kwargs: Any) -> Any:
        config = _route_config(args, kwargs)
        if routed(config):
            from ..deepspeed.initializer import initialize as mt_initialize
            from .engine_reuse import initialize_once

            hf_stage.one_rank_group()
            road = ("deepspeed.initialize (HF Trainer / accelerate)" if has_megatrain_section(config)
                    else "deepspeed.initialize under megatrain launch")
            with start_line.via(road):
                result = initialize_once(mt_initialize, args, rest, kwargs)
            hf_stage.unwrap_engines()  # accelerate and transformers are imported by now: unwrap_model finds the model
            return result
        on_deepspeed.announce(on_deepspeed.NO_SECTION)
        return real_initialize(args, *rest, **kwargs)

    def zero_init(*args: Any, **kwargs: Any) -> Any:
        # transformers builds models under deepspeed.zero.Init when the config says stage 3; MegaTrain wants the
        # model whole on the host (it takes the storage over itself), so a MegaTrain config gets a no-op context.
        config = kwargs.get("config_dict_or_path", kwargs.get("config"))
        if routed(config):
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
    _saved.update(initialize=real_initialize, config_init=real_config_init, zero_init=real_zero_init,
                  init_distributed=real_init_distributed)
    deepspeed.initialize = initialize
    deepspeed.init_distributed = deepspeed.comm.init_distributed = init_distributed
    deepspeed.zero.Init = zero_init
    DeepSpeedConfig.__init__ = config_init


def uninstall() -> None:
    """Undo `install()` (tests; a process that wants real DeepSpeed only again)."""
    resume_residency.uninstall()
    if not _saved:
        hf_stage.uninstall()
        return
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig

    deepspeed.initialize = _saved.pop("initialize")
    deepspeed.init_distributed = deepspeed.comm.init_distributed = _saved.pop("init_distributed")
    deepspeed.zero.Init = _saved.pop("zero_init")
    DeepSpeedConfig.__init__ = _saved.pop("config_init")
    hf_stage.uninstall()


def installed() -> bool:
    return bool(_saved)


install()
