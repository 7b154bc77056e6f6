"""Which placement advisor the engine gets: the planner's search (planner/advice.py) where the device is a GPU a
hardware profile describes and residency is "auto"; none otherwise (a CPU device has no budget: everything fits,
and the engine's own fill keeps it all). The backend decides because it is the one part that sees both the engine
and the planner, which never import each other."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from ..config.schema import EngineConfig
from ..costs.advice import PlacementAdvice
from ..engine import local_ranks
from ..run import train_state

log = logging.getLogger("megatrain")


def host_share_bytes() -> int | None:
    """This rank's share of the node's host memory: the planner's point is one process, and each of the node's
    ranks (LOCAL_WORLD_SIZE) keeps its own offloaded graphs and rollback copies there, so each plans with an
    equal share (conservative where a node store holds the model's state once)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX host: the profile's host size stands
        return None
    return total // local_ranks()


# On a model (its instance dict): the residency record of the checkpoint its Trainer run resumes from, carried there by
# integrations/resume_residency.py for the engine that the run's deepspeed.initialize builds over this model.
RESUMED = "_megatrain_resumed_residency"


def resumed_record(model: Any) -> dict[str, Any] | None:
    """The residency record `model` carries (resume_residency.py), None where it carries none."""
    return getattr(model, "__dict__", {}).get(RESUMED)


def advice_for(device: torch.device, model: Any, config: EngineConfig,
               device_name: str | None = None) -> PlacementAdvice | None:
    """`placement_advice`, placing the optimizer-resident count of the checkpoint `model`'s run resumes from where
    it carries one and residency is "auto" (train_state.CheckpointResidency around the planner's advisor, which
    still places the kept weights and graphs); counts the user set are theirs."""
    inner = placement_advice(device, model, config, device_name)
    record = resumed_record(model)
    if record is None or config.residency_set is not None:
        return inner
    return train_state.CheckpointResidency(record, inner)


def placement_advice(device: torch.device, model: Any, config: EngineConfig,
                     device_name: str | None = None) -> PlacementAdvice | None:
    """The advisor for an engine on `device` (`device_name`: as torch.cuda.get_device_name reports it; read from
    the device where not given), or None: the engine's own fill."""
    if device.type != "cuda" or config.residency_set is not None:
        return None
    from ..planner import Advisor, profile_for_device  # the planner only where it is asked

    name = device_name if device_name is not None else torch.cuda.get_device_name(device)
    hw = profile_for_device(name, host_bytes=host_share_bytes())
    if hw is None:
        log.info("residency: no hardware profile for %r: the engine's own fill (weights, then graphs)", name)
        return None
    hf_config = getattr(model, "config", None)
    try:
        return Advisor(hf_config, hw)
    except (ValueError, TypeError, KeyError) as e:  # a model the planner cannot shape: the engine plans alone
        log.info("residency: the planner cannot shape this model (%s): the engine's own fill", e)
        return None
