"""Phase sync: no synchronising CUDA call inside the per-layer loop, and a planted one that must be caught."""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .common import Ctx, make_batches, tiny_model

# == sync ===============================================================================================
_SYNC_PRONE = ("item", "tolist", "__bool__", "__float__", "__int__", "nonzero", "numpy")


@contextlib.contextmanager
def sync_watch(device: Any, hits: list[str]) -> Iterator[None]:
    """Record every synchronizing call made inside the block.

    On CUDA this is torch's own detector (`set_sync_debug_mode`), which sees syncs in C++ too. On the
    CPU nothing synchronizes, so the Python calls that would (`.item()`, `bool(t)`, `.nonzero()`, ...)
    are counted instead: the same loop then fails the same way in CI as on the GPU.
    """
    import torch

    if device.type == "cuda":
        prev = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode(prev)
        hits.extend(f"{Path(w.filename).name}:{w.lineno}: {str(w.message).splitlines()[0][:100]}"
                    for w in caught if "synchroniz" in str(w.message))
        return
    originals = {name: getattr(torch.Tensor, name) for name in _SYNC_PRONE}

    def spy(name: str, orig: Callable) -> Callable:
        def wrapper(self: Any, *a: Any, **k: Any) -> Any:
            caller = sys._getframe(1)
            hits.append(f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno}: Tensor.{name}")
            return orig(self, *a, **k)
        return wrapper

    try:
        for name, orig in originals.items():
            setattr(torch.Tensor, name, spy(name, orig))
        yield
    finally:
        for name, orig in originals.items():
            setattr(torch.Tensor, name, orig)


def watch_layer_loop(eng: Any, hits: list[str]) -> None:
    """Count syncs inside the per-layer loops (forward and backward) of this engine from now on."""
    pipe = eng.pipeline
    for name in ("forward", "backward"):
        orig = getattr(pipe, name)

        def watched(*a: Any, _orig: Callable = orig, **k: Any) -> Any:
            with sync_watch(eng.device, hits):
                return _orig(*a, **k)

        setattr(pipe, name, watched)


def _one_step(eng: Any, batch: dict) -> Any:
    out = eng(**batch)
    eng.backward(out.loss)
    eng.step()
    eng.zero_grad()
    return out.loss


def phase_sync(ctx: Ctx) -> None:
    import torch

    from megatrain.config import EngineConfig
    from megatrain.engine import Engine

    sh = ctx.shapes()
    batch = make_batches(1, sh)[0]
    dev = str(ctx.device)

    def loop(mask: bool = True, **knobs: Any) -> dict[str, Any]:
        eng = Engine(tiny_model("llama", sh), EngineConfig(device=dev, **knobs))
        b = batch if mask else {"input_ids": batch["input_ids"], "labels": batch["input_ids"]}
        _one_step(eng, b)  # warm-up: first-touch allocations are not the loop's steady state
        inside: list[str] = []
        outside: list[str] = []
        watch_layer_loop(eng, inside)
        with sync_watch(ctx.device, outside):
            _one_step(eng, b)
        return {"ok": not inside, "syncs_in_loop": len(inside), "in_loop": inside[:10],
                "syncs_outside_loop": len(outside), "outside_loop": sorted(set(outside))[:15]}

    ctx.check("loop_fp32_no_mask", lambda: loop(mask=False))
    ctx.check("loop_fp32", lambda: loop())
    ctx.check("loop_bf16", lambda: loop(compute_dtype="bfloat16"))
    ctx.check("loop_bf16_offload", lambda: loop(compute_dtype="bfloat16", offload_activations=True))
    ctx.check("loop_bf16_trace", lambda: loop(compute_dtype="bfloat16", trace=True))

    def planted() -> dict[str, Any]:
        # Negative control: the detector must see an `.item()` planted inside the loop.
        eng = Engine(tiny_model("llama", sh), EngineConfig(device=dev))
        orig = eng.templates.call

        def call(i: int, w: Any, h: Any, *rest: Any) -> Any:
            float(h.float().sum())
            return orig(i, w, h, *rest)

        eng.templates.call = call
        inside: list[str] = []
        watch_layer_loop(eng, inside)
        _one_step(eng, batch)
        return {"ok": len(inside) >= sh.layers, "syncs_caught": len(inside), "example": inside[:2]}

    ctx.check("planted_sync_is_caught", planted)

    def memory_and_streams() -> dict[str, Any]:
        eng = Engine(tiny_model("llama", sh), EngineConfig(device=dev, compute_dtype="bfloat16",
                                                          offload_activations=True))
        eng(**batch)  # a training forward: its offloaded activations are held for backward
        pending = eng._pending
        res: dict[str, Any] = {"device": dev}
        if not ctx.cuda:
            return {**res, "ok": True, "note": "pinning and CUDA streams exist only on a GPU"}
        res["pinned"] = {
            "layer_stream_sources": all(g.stream_source.is_pinned() for g in eng.store.layers),
            "layer_masters": all(g.master.is_pinned() for g in eng.store.layers),
            "grad_slabs": all(g.grad.is_pinned() for g in eng.store.groups()),
            "globals_master": bool(eng.store.globals.master.is_pinned()),
            "grad_staging": all(s.is_pinned() for s in eng.pipeline._staging),
            "offloaded_activations": all(h.is_pinned() for h, _ in pending.acts._host.values()),
        }
        compute = torch.cuda.current_stream()
        h2d, d2h = eng.streams.h2d._stream, eng.streams.d2h._stream
        res["streams"] = {"h2d_is_side_stream": h2d != compute, "d2h_is_side_stream": d2h != compute,
                          "h2d_d2h_distinct": h2d != d2h}
        res["ok"] = all(res["pinned"].values()) and all(res["streams"].values())
        return res

    ctx.check("pinned_memory_and_side_streams", memory_and_streams)


# == stress ==============================================================================================
