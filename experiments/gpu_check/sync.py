"""Phase sync: no synchronising CUDA call inside the per-layer loop, and a planted one that must be caught."""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .common import Ctx, make_batches, tiny_model
from .sanitizer_run import PLACEMENTS, placement_ok


def pinning_expectations(store: Any, staging: list[Any]) -> dict[str, tuple[list[Any], bool]]:
    """The host store's buffers by role, each with whether the design pins it (costs/pinning.py, HostStore):
    what the device reads (each layer's stream source, the resident masters) and the gradient staging are
    pinned; an FP32 master behind a bf16 shadow and the gradient slabs are touched by host threads only, and
    stay pageable (pinning them would lock memory no copy uses)."""
    return {
        "layer_stream_sources": ([g.stream_source for g in store.layers], True),
        # pinned only where the upload copies from them (FP32 compute); bf16 uploads its own bf16 staging
        "globals_master": ([store.globals.master], store.resident_masters_copied),
        "grad_staging": (list(staging), True),
        "layer_masters_behind_a_shadow_pageable": (
            [g.master for g in store.layers if g.master is not None and g.shadow is not None], False),
        "grad_slabs_pageable": ([g.grad for g in store.groups() if g.grad is not None], False),
    }


def pinning_report(expect: dict[str, tuple[list[Any], bool]],
                   is_pinned: Callable[[Any], bool] = lambda t: bool(t.is_pinned())) -> dict[str, bool]:
    """Per role: whether every buffer's pinned state is the one the design gives it."""
    return {name: all(is_pinned(t) == want for t in buffers) for name, (buffers, want) in expect.items()}


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

    from megatrain.config.schema import EngineConfig
    from megatrain.engine import Engine

    sh = ctx.shapes()
    batch = make_batches(1, sh)[0]
    dev = str(ctx.device)

    def loop(mask: bool = True, **knobs: Any) -> dict[str, Any]:
        if knobs["residency"] != "stream":
            knobs.setdefault("offload_activations", False)  # kept graphs need activations on the device
        eng = Engine(tiny_model("llama", sh), EngineConfig(parity_probe=False, device=dev, **{"compute_dtype": "float32", **knobs}))
        b = batch if mask else {"input_ids": batch["input_ids"], "labels": batch["input_ids"]}
        _one_step(eng, b)  # warm-up: first-touch allocations are not the loop's steady state
        inside: list[str] = []
        outside: list[str] = []
        watch_layer_loop(eng, inside)
        eng.reset_stats()
        with sync_watch(ctx.device, outside):
            _one_step(eng, b)
        st = eng.collect_stats()
        kept = [st["resident_weight_layers"], st["kept_graph_layers"]]
        # The placement asked for, not a budget's choice: streamed layers (ring reuse, recompute) in every run.
        placed = placement_ok(knobs["residency"], kept, st["recomputed_layers"], sh.layers)
        return {"ok": not inside and placed, "syncs_in_loop": len(inside), "in_loop": inside[:10],
                "syncs_outside_loop": len(outside), "outside_loop": sorted(set(outside))[:15],
                "residency": knobs["residency"], "kept_weights_graphs": kept,
                "recomputed_layers": st["recomputed_layers"], "placement_ok": placed}

    # Every loop at each placement of the sanitizer phase (sanitizer_run.PLACEMENTS): all streamed, and some
    # layers kept beside streamed ones; never "auto", which keeps every layer of these models on a large device.
    for where, place in PLACEMENTS.items():
        r = place["residency"]
        ctx.check(f"loop_fp32_no_mask_{where}", lambda r=r: loop(mask=False, residency=r))
        ctx.check(f"loop_fp32_{where}", lambda r=r: loop(residency=r))
        ctx.check(f"loop_bf16_{where}", lambda r=r: loop(compute_dtype="bfloat16", residency=r))
        ctx.check(f"loop_bf16_trace_{where}", lambda r=r: loop(compute_dtype="bfloat16", trace=True, residency=r))
    ctx.check("loop_bf16_offload_stream", lambda: loop(compute_dtype="bfloat16", offload_activations=True,
                                                       residency="stream"))

    def planted() -> dict[str, Any]:
        # Negative control: the detector must see an `.item()` planted inside the loop.
        eng = Engine(tiny_model("llama", sh), EngineConfig(parity_probe=False, device=dev))
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
        eng = Engine(tiny_model("llama", sh), EngineConfig(parity_probe=False, device=dev, compute_dtype="bfloat16",
                                                          offload_activations=True))
        eng(**batch)  # a training forward: its offloaded activations are held for backward
        pending = eng._pending
        res: dict[str, Any] = {"device": dev}
        if not ctx.cuda:
            return {**res, "ok": True, "note": "pinning and CUDA streams exist only on a GPU"}
        # Pinned exactly where a DMA copy reads or writes, pageable where only host threads do (HostStore).
        expect = pinning_expectations(eng.store, list(eng.pipeline._staging))
        expect["offloaded_activations"] = ([h for h, _ in pending.acts._host.values()], True)
        expect["resident_upload_staging"] = ([eng.placement.upload.staging], True)  # bf16: rounded masters go up
        res["pinned"] = pinning_report(expect)
        compute = torch.cuda.current_stream()
        h2d, d2h = eng.streams.h2d._stream, eng.streams.d2h._stream
        res["streams"] = {"h2d_is_side_stream": h2d != compute, "d2h_is_side_stream": d2h != compute,
                          "h2d_d2h_distinct": h2d != d2h}
        res["ok"] = all(res["pinned"].values()) and all(res["streams"].values())
        return res

    ctx.check("pinned_memory_and_side_streams", memory_and_streams)

    def resident_upload() -> dict[str, Any]:
        # bf16 on CUDA: after a step the embedding/norm/head go up from pinned bf16 staging, rounded on the host
        # (engine/host/resident_upload.py); the device copies must hold exactly the bits a cast of the masters gives.
        eng = Engine(tiny_model("llama", sh), EngineConfig(parity_probe=False, device=dev, compute_dtype="bfloat16"))
        _one_step(eng, batch)
        eng.synchronize()
        same = all(torch.equal(d.detach().cpu().view(torch.int16), m.detach().to(torch.bfloat16).view(torch.int16))
                   for d, m in zip(eng.placement.device_globals, eng.store.globals.params))
        up = eng.placement.upload
        res: dict[str, Any] = {"device": dev, "device_copies_equal_cast": same, "staged": up is not None}
        if not ctx.cuda:  # the CPU device keeps its plain cast: no staging
            return {**res, "ok": same and up is None}
        res.update(staging_pinned=bool(up.staging.is_pinned()), staging_dtype=str(up.staging.dtype))
        res["ok"] = same and res["staging_pinned"] and up.staging.dtype == torch.bfloat16
        return res

    ctx.check("resident_upload_from_pinned_bf16", resident_upload)


# == stress ==============================================================================================
