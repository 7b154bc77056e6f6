"""The engine's residency "auto" as the planner's search: what a run on a known GPU keeps on its device.

The engine alone fills its device room in a fixed order (costs/memory.py: kept weights, then graphs, the
optimizer-resident layers sized when it is built). That order needs no timing model, so it cannot tell a kept
graph (one recompute saved) from a layer's optimizer state (its host update and copies saved): at llama2-7b on an
H200 at 1 x 4096 it is predicted ~16% slower than the best placement. The planner can tell, by replaying each
placement on the hardware profile's rates (placement.py `search`). Where the engine's device matches a profile of
megatrain/data/hardware.yaml (`profile_for_device`), the backend hands the engine an `Advisor`: the same search,
on the profile's compute, link and host rates, the run's own device budget and host memory, and the engine's
settled configuration, so "auto" on that device is what `megatrain plan` prints for it.

The engine asks twice: once when it is built, for the optimizer-resident count (its state cannot move later), at
one sequence of the model's context window (the batch the engine's own fill reserves room for); then at each
training batch's first plan, for kept weights and graphs, with that count fixed. An advice that does not fit the
room the engine measures is not taken (costs/memory.py checks it); a device no profile matches keeps the engine's
own fill.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..config.schema import EngineConfig
from ..costs import residency as kept
from .hardware import Hardware, get_hardware
from .memory import long_context_plan
from .placement import place
from .point import make_point
from .shapes import resolve_model

# (substring of torch.cuda.get_device_name, profile): the first match wins, so a name that contains another's
# ("GH200" contains "H200") comes first. The profiles' host link is what the card's form implies: an H100 whose
# name says PCIe is the PCIe card, any other H100 the SXM one.
DEVICE_PROFILES: tuple[tuple[str, str], ...] = (
    ("GH200", "gh200"),
    ("H200", "h200-pcie"),
    ("H100 PCIe", "h100-pcie"),
    ("H100", "h100-sxm"),
    ("A100", "a100-pcie"),
    ("4090", "rtx4090"),
    ("V100", "v100-dgx2"),
)


def profile_for_device(name: str, device_bytes: int | None = None, host_bytes: int | None = None) -> Hardware | None:
    """The hardware profile for a device `name` as torch reports it (None: no profile matches), with the device's
    and host's memory replaced by the run's own (`device_bytes`, `host_bytes`) where given: the rates are the
    profile's, the sizes this machine's."""
    profile = next((p for key, p in DEVICE_PROFILES if key.lower() in name.lower()), None)
    if profile is None:
        return None
    hw = get_hardware(profile)
    changes: dict[str, Any] = {}
    if device_bytes is not None:
        changes["device_memory_gib"] = device_bytes / 2**30
    if host_bytes is not None:
        changes["host_memory_gib"] = host_bytes / 2**30
    return hw.with_(**changes) if changes else hw


class Advisor:
    """The planner's placement for the engine's batches (costs/advice.py PlacementAdvice; see the module
    docstring). Each call takes the device budget the engine plans against (its `device_budget_bytes`, or the free
    device memory it measured)."""

    def __init__(self, hf_config: Any, hardware: Hardware) -> None:
        self.model = resolve_model(hf_config)
        self.hardware = hardware
        self._seen: dict[tuple, kept.Residency | None] = {}  # a search replays dozens of steps: once per shape

    @property
    def source(self) -> str:
        return f"the planner's search on the {self.hardware.name} profile"

    def shape(self, tokens: int) -> tuple[int, int]:
        """(context, micro-batch) of a batch of `tokens`: sequences of the model's context window, or one shorter
        sequence (the engine plans by tokens; the split only moves the attention's share of the compute)."""
        context = max(1, min(tokens, self.model.max_positions))
        return context, max(1, tokens // context)

    def optimizer_layers(self, config: EngineConfig, budget: int) -> int:
        """The optimizer-resident count for the engine being built: the search's at one context-window sequence."""
        r = self.residency(config, self.model.max_positions, budget)
        return 0 if r is None else r.optimizer

    def residency(self, config: EngineConfig, tokens: int, budget: int,
                  optimizer: int | None = None) -> kept.Residency | None:
        """The search's placement for a training batch of `tokens` (`optimizer`: the count the engine fixed when it
        was built; None: the search's own), or None where the point cannot be planned."""
        key = (int(budget), _knobs(config), *self.shape(tokens), optimizer)
        if key not in self._seen:
            self._seen[key] = _search(self.model, self.hardware, *key)
        return self._seen[key]


# What stands in for a host mode still "auto" when the engine asks (it chooses it before it does)
PLACEHOLDER = {"host_master": "fp32", "host_grad_dtype": "float32"}


def _knobs(config: EngineConfig) -> tuple[tuple[str, Any], ...]:
    """What the planner's point takes from the engine's configuration, hashable for the cache: settled values as
    they are, an "auto" still open (a host mode the engine has not chosen yet; the rollback copy's fit, which the
    planner measures against the profile's host) as the point's own "auto", a host mode still open as the FP32
    master and slabs."""
    # the engine settles the host mode before it asks; the FP32 one stands in for one still open
    values = config.with_stand_ins(PLACEHOLDER)
    out: list[tuple[str, Any]] = [("dtype", config.compute_dtype)]
    for name in ("num_buffers", "loss_chunk_tokens", "offload_activations", "mlp_tile_tokens", "optimizer_overlap",
                 "speculative_step", "host_master", "host_grad_dtype", "optimizer_in_backward"):
        out.append((name, values[name]))
    return tuple(out)


def _search(model: Any, hw: Hardware, budget: int, knobs: tuple[tuple[str, Any], ...], context: int, batch: int,
            optimizer: int | None) -> kept.Residency | None:
    settings = dict(knobs)
    try:
        p = make_point(model, context, batch, device_budget_bytes=budget, **settings)
    except ValueError:
        return None  # a setting the planner does not model: the engine's own fill
    lc = long_context_plan(p, hw)
    if optimizer is None:
        _, _, placement = place(p, hw, lc)
        return None if placement is None else placement.chosen
    # The engine's count is fixed: the same search (weights, graphs, offloaded graphs) beside it, and of what it
    # replayed the fastest placement that fits (its starting point, the fill at another count, may not).
    lc = dataclasses.replace(lc, residency=dataclasses.replace(lc.residency, optimizer=min(optimizer, lc.n_layers)))
    placed, _, placement = place(p, hw, lc, trade_optimizer=False)
    if placement is None:
        return None
    fitting = {r: s for r, s in placement.step_s.items() if placed.fits(r)}
    if placement.chosen in fitting:
        return placement.chosen
    return min(fitting, key=fitting.__getitem__) if fitting else None
