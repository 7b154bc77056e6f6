"""The pieces of `accelerate.Accelerator` that cannot apply when MegaTrain (or a comparison backend) is the engine,
each refused by name with the reason and what to do instead.

Everything else is accelerate's own (the face is a subclass): its state, logging, data-loader sharding, RNG
synchronisation, schedulers, trackers, checkpoint layout and collectives.
"""

from __future__ import annotations

import os
from typing import Any

# Constructor arguments that configure an engine the backend replaces: the value that means "not used", and why.
REFUSED_ARGUMENTS: dict[str, tuple[Any, str]] = {
    "deepspeed_plugin": (None, "the backend is the engine; for accelerate's DeepSpeed road keep "
                               "`from accelerate import Accelerator` and add a \"megatrain\" section to the DeepSpeed "
                               "config"),
    "deepspeed_plugins": (None, "the backend is the engine (see deepspeed_plugin)"),
    "fsdp_plugin": (None, "FSDP shards a model the backend already holds (backend='megatrain' keeps it in host "
                          "memory; backend='zero3' partitions it)"),
    "megatron_lm_plugin": (None, "Megatron-LM's tensor/pipeline parallel engine is not the backend"),
    "torch_tp_plugin": (None, "tensor parallelism is not supported by the backend"),
    "parallelism_config": (None, "tensor/context/sharded parallelism is not supported by the backend; data "
                                 "parallel needs no config (launch several processes)"),
    "dynamo_plugin": (None, "torch.compile of the model: the backend runs its own forward"),
    "dynamo_backend": (None, "torch.compile of the model: the backend runs its own forward"),
}

# Environment variables `accelerate launch` sets for an engine the face cannot be (accelerate reads them in
# Accelerator.__init__): the road each one belongs to.
REFUSED_ENVIRONMENT: dict[str, str] = {
    "ACCELERATE_USE_DEEPSPEED": "accelerate launch with a DeepSpeed config is accelerate's DeepSpeed road: keep "
                                "`from accelerate import Accelerator` (a \"megatrain\" section in the DeepSpeed config "
                                "puts MegaTrain behind it), or launch without the DeepSpeed config",
    "ACCELERATE_USE_FSDP": "accelerate launch with an FSDP config: launch without it (the backend is the engine)",
    "ACCELERATE_USE_MEGATRON_LM": "accelerate launch with a Megatron-LM config: launch without it",
    "ACCELERATE_USE_PARALLELISM_CONFIG": "accelerate launch with a parallelism config: launch without it",
}

# Public methods of accelerate.Accelerator that cannot apply: calling one raises, naming it.
REFUSED_METHODS: dict[str, str] = {
    "lomo_backward": "LOMO fuses the update into the backward; the backend owns the optimizer step",
    "deepspeed_ulysses_dl_adapter": "DeepSpeed's sequence parallel: accelerate's DeepSpeed road only",
    "join_uneven_inputs": "DDP's Join: the backend's ranks take the same number of steps (keep even_batches=True)",
}


def check_arguments(given: dict[str, Any]) -> None:
    """Raise for an accelerate argument or launch environment this face cannot honour."""
    for name, value in given.items():
        if name in REFUSED_ARGUMENTS and value is not REFUSED_ARGUMENTS[name][0] and not (
                name == "dynamo_backend" and str(value).lower() == "no"):
            raise ValueError(f"megatrain.Accelerator does not take {name}={value!r}: {REFUSED_ARGUMENTS[name][1]}")
    for var, why in REFUSED_ENVIRONMENT.items():
        if os.environ.get(var, "false").lower() == "true":
            raise ValueError(f"megatrain.Accelerator: {var}=true in the environment: {why}")
    dynamo = os.environ.get("ACCELERATE_DYNAMO_BACKEND", "no").lower()
    if dynamo not in ("no", ""):
        raise ValueError(f"megatrain.Accelerator: ACCELERATE_DYNAMO_BACKEND={dynamo!r}: torch.compile of the model "
                         "cannot apply, the backend runs its own forward; launch with --dynamo_backend no")


def refused(name: str) -> RuntimeError:
    return RuntimeError(f"megatrain.Accelerator.{name}() cannot apply: {REFUSED_METHODS[name]}")
