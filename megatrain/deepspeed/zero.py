"""`deepspeed.zero` (also `deepspeed.runtime.zero.partition_parameters`): `Init`, `GatheredParameters`,
`ZeroParamStatus`, for scripts and libraries written for ZeRO-3.

MegaTrain never partitions a parameter: the model is built whole on the host and its parameters are the
engine's host masters, so these only keep the engine's copies consistent with what the script reads and writes.
A parameter here has no `ds_id` / `ds_status`: code that asks `hasattr(p, "ds_id")` before gathering (DeepSpeed-Chat's
`_z3_params_to_fetch`) finds nothing to fetch, as DeepSpeed at stages 0-2.
"""

from __future__ import annotations

import contextlib
import enum
from typing import Any

import torch

from ..costs.modes import HostMaster

__all__ = ["Init", "GatheredParameters", "ZeroParamStatus", "register_external_parameter",
           "unregister_external_parameter"]


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's states of a partitioned parameter (same names and values); a parameter here is always whole."""

    AVAILABLE = 1  # the whole parameter is there
    NOT_AVAILABLE = 2  # partitioned away (never, on MegaTrain)
    INFLIGHT = 3  # being gathered (never, on MegaTrain)


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """ZeRO-3's note that `module` uses a parameter it does not own: nothing is gathered on use here."""


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Undo `register_external_parameter`: nothing to undo."""


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
    `modifier_rank` leaving hands what was written to the engine (its device and bf16 copies follow).

    With host_master 'hilo' or 'bf16' a layer's Parameter is a view of a shared FP32 scratch, not a master: inside
    the block it holds the layer's values (one layer's at a time), and what was written there, or into the FP32
    copies `model.named_parameters()` serves (also a resident parameter's in bf16 compute), is loaded into the host
    store on leaving (data parallel: every rank loads the modifier rank's values)."""

    def __init__(self, params: Any, modifier_rank: int | None = None, fwd_module: Any = None,
                 enabled: bool = True) -> None:
        # The engine is imported once a script gathers, not by `import megatrain as deepspeed`.
        from ..engine import engines_holding

        params = [params] if torch.is_tensor(params) else list(params or [])
        self._params = params
        self._engines = engines_holding(params) if enabled else []
        self._modifier_rank = modifier_rank
        self._scratch: list = []

    def __enter__(self) -> GatheredParameters:
        for eng in self._engines:
            eng.synchronize()
            self._scratch += _gather_into_scratch(eng, self._params)
        return self

    def __exit__(self, *exc: Any) -> bool:
        try:
            if self._modifier_rank is not None and exc[0] is None:
                for eng in self._engines:
                    written = _served_writes(eng, self._params)
                    if eng.store.master_mode is HostMaster.FP32:
                        eng.params_written(self._modifier_rank)
                    if written:
                        _load_from(eng, written, self._modifier_rank)
        finally:
            with torch.no_grad():
                for p, before in self._scratch:
                    p.copy_(before)  # the scratch as the update path left it
            self._scratch = []
        return False


def _load_from(engine: Any, written: dict[str, torch.Tensor], src: int) -> None:
    """`written` (HF names -> FP32 values) into `engine`'s host store, rank `src`'s values on every rank."""
    if engine.world_size > 1:
        import torch.distributed as dist

        for name in sorted(written):
            value = written[name].to(engine.device)
            dist.broadcast(value, src)
            written[name] = value.cpu()
    engine.load_state_dict(written, strict=False)


Init = _NoOpContext


def _layer_slots(engine: Any) -> dict[int, tuple[Any, Any]]:
    """id(layer Parameter) -> (its FlatGroup, its Slot): where a scratch-backed Parameter's values live."""
    return {id(p): (g, s) for g in engine.store.layers for s, p in zip(g.slots, g.params)}


def _gather_into_scratch(engine: Any, tensors: list[torch.Tensor]) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """For a `GatheredParameters` block (above): the scratch-backed layer Parameters among
    `tensors` (host_master 'hilo' / 'bf16', where a layer's Parameter is a view of the shared FP32 scratch) hold
    their layer's FP32 values for the block, so reads see the weight and writes can be taken (`_served_writes`).
    Returns (Parameter, the scratch's content before) to put back after. Parameters of two layers at once would
    share the scratch: refused by name."""
    if engine.store.master_mode is HostMaster.FP32:
        return []
    slots = _layer_slots(engine)
    mine = [(t, slots[id(t)]) for t in tensors if id(t) in slots]
    layers = {id(g) for _, (g, _) in mine}
    if len(layers) > 1:
        raise RuntimeError(f"GatheredParameters over parameters of {len(layers)} decoder layers at once with "
                           f"host_master={engine.config.host_master!r}: a layer's parameters share one FP32 scratch "
                           "with every other layer's; gather one layer's at a time (or the copies "
                           "model.named_parameters() serves)")
    out = []
    with torch.no_grad():
        for p, (g, slot) in mine:
            out.append((p, p.detach().clone()))
            p.copy_(g.read_slot(slot))
    return out


def _served_writes(engine: Any, tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The values of `tensors` that stand apart from the masters, by their HF names: the copies the model object
    served (named_parameters: a hilo layer's FP32 copy, a resident parameter's FP32 copy in bf16 compute) and the
    scratch-backed layer Parameters filled by `_gather_into_scratch`. Loaded into the engine (load_state_dict),
    they reach the host store and every copy the engine keeps (what a `GatheredParameters(modifier_rank=...)`
    block wrote)."""
    slots = _layer_slots(engine) if engine.store.master_mode is not HostMaster.FP32 else {}
    index = {id(g): i for i, g in enumerate(engine.store.layers)}
    group = engine.store.globals
    globals_ = {id(d): (s.name, m) for d, s, m in zip(engine.placement.device_globals, group.slots, group.params)}
    out: dict[str, torch.Tensor] = {}
    for t in tensors:
        stands_for = getattr(t, "megatrain_copy_of", t)
        if id(stands_for) in slots:
            g, slot = slots[id(stands_for)]
            out[f"{engine.parts.layers_prefix}.{index[id(g)]}.{slot.name}"] = t.detach().to("cpu", torch.float32)
        elif id(stands_for) in globals_:
            name, master = globals_[id(stands_for)]
            # a served FP32 copy; or, where params_written is not the way (no FP32 layer masters), a resident
            # parameter's device copy written in place (as params_written takes it: whole, where it changed)
            if stands_for is not t or (slots and not torch.equal(t.detach().to(master.device),
                                                                  master.detach().to(t.dtype))):
                out[name] = t.detach().to("cpu", torch.float32)
    return out
