"""One line at the start of every run on MegaTrain: which face, the device, the compute dtype, the host mode, the
optimizer that steps, what MegaTrain turned off or ignored, the residency setting (what "auto" keeps on the
device is planned at the first batch and logged by the engine, engine/pipeline/schedule.py) and the host threads:
the optimizer pool's, then the reducer's (on CUDA) and this process's share of the cores they come from
(engine/runtime/threads.py: affinity over LOCAL_WORLD_SIZE, never OMP_NUM_THREADS).

A Trainer, TRL, LlamaFactory or axolotl run reaches MegaTrain through DeepSpeed's name; without this line nothing
said it was not DeepSpeed training (and MegaTrain turns some of their settings off, e.g. HF gradient checkpointing:
the engine recomputes each streamed layer itself). Written once per engine, by the main process of a launch, to the
"megatrain" logger when it is enabled for INFO, else to stderr: a script that configured logging at WARNING still
sees it.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any

from ..engine import host_cores, side_threads, update_threads

__all__ = ["describe", "announce", "via", "route"]

PREFIX = "MegaTrain is training"
_route: list[str] = []  # how the current initialize was reached, innermost last (see `via`)


@contextlib.contextmanager
def via(how: str) -> Iterator[None]:
    """Name the road into the face for start lines written inside (e.g. HF Trainer's `deepspeed.initialize`)."""
    _route.append(how)
    try:
        yield
    finally:
        _route.pop()


def route() -> str | None:
    return _route[-1] if _route else None


def _host_mode(config: Any, world_size: int) -> str:
    # in FP32 compute "auto" has one exact master to take: no choice to name
    chose = ("host mode \"auto\" chose " if getattr(config, "chooses_host_mode", False)
             and config.compute_dtype == "bfloat16" else "")
    parts = [f"{chose}{config.host_master} master"]
    if not config.optimizer_in_backward:
        parts.append(f"{config.host_grad_dtype} gradients")
    else:
        parts.append("optimizer in backward")
    if config.nvme_path is not None:
        parts.append(f"NVMe tier at {config.nvme_path}")
    if world_size > 1:
        parts.append(f"{world_size} ranks, {config.data_parallel_host} host store")
    return ", ".join(parts)


def _host_threads(engine: Any) -> str:
    update = getattr(engine, "update", None)
    pool = getattr(update, "threads", None) or update_threads(False)
    parts = [f"{pool} optimizer"]
    if getattr(engine.device, "type", None) == "cuda":
        parts.append(f"{side_threads()} reducer")
    parts.append(f"of {host_cores()} cores")
    return ", ".join(parts)


def _plan(engine: Any) -> str:
    """The choices the engine's plan made (megatrain/config/settle.py) and those it leaves to a rule per batch."""
    cfg = engine.config
    parts = ["pinned host memory" if cfg.pin_memory else "pageable host memory",
             "update overlapped with the next forward" if cfg.optimizer_overlap else "update in step()"]
    layers = getattr(getattr(engine, "update", None), "speculative_layers", 0)
    parts.append(f"speculative step on {layers} layers" if cfg.speculative_step else "no speculative step")
    per_batch = cfg.per_batch() if hasattr(cfg, "per_batch") else ()
    if per_batch:
        parts.append("per batch: " + ", ".join(per_batch))
    return ", ".join(parts)


def describe(face: str, engine: Any, optimizer: Any = None, turned_off: list[str] | None = None,
             replaced: str | None = None) -> str:
    """The start line for `engine` (a `megatrain.engine.Engine`) trained through `face`."""
    how = route()
    face = f"{face} via {how}" if how else face
    cfg = engine.config
    dp = getattr(engine, "dp", None)
    world = dp.world_size if dp is not None else 1
    path = getattr(engine, "data_path", None)  # which data path several ranks take (engine/parallel/node_path.py)
    data = f" | data path: {path.describe()}" if path is not None and world > 1 else ""
    if optimizer is None:
        opt = "none (forward only)"
    else:
        opt = type(optimizer).__name__ + (f" ({replaced})" if replaced else "")
    off = "; ".join(turned_off) if turned_off else "nothing"
    res = cfg.residency
    kept = res if isinstance(res, str) else (f"{res.weights} layers' weights, {res.activations} activations"
                                              if res.weights else "stream")
    advice = getattr(engine, "placement_advice", None)
    kept += f" ({advice.source})" if advice is not None and isinstance(res, str) else ""
    on_device = len(getattr(engine, "optimizer_layers", ()))  # chosen when the engine was built (resident.py)
    src = "from checkpoint" if getattr(advice, "source", None) == "from checkpoint" else "chosen"
    kept += f", {on_device} layers' optimizer on the device ({src})" if on_device else ""
    # the resident parameters' (embedding, norm, head) with them (resident.py place_globals)
    kept += " (and the embedding/norm/head's)" if getattr(engine, "globals_on_device", False) else ""
    return (f"{PREFIX} | face: {face} | device: {engine.device} | compute: {cfg.compute_dtype} | "
            f"host: {_host_mode(cfg, world)} | optimizer: {opt} | turned off: {off} | residency: {kept} | "
            f"host threads: {_host_threads(engine)} | plan: {_plan(engine)}{data}")


def announce(line: str, engine: Any) -> None:
    """Write `line` once, on the launch's main process."""
    dp = getattr(engine, "dp", None)
    if dp is not None and dp.rank != 0:
        return
    logger = logging.getLogger("megatrain")
    if logger.isEnabledFor(logging.INFO) and (logger.handlers or logging.getLogger().handlers):
        logger.info(line)
    else:
        print(f"[megatrain] {line}", file=sys.stderr, flush=True)
