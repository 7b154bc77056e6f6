"""Phase parity: the engine against plain PyTorch on the device (FP32 Llama and tied Qwen2, bf16, offloaded
activations, the overlapped optimizer, 1 and 3 device buffers)."""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable
from typing import Any

from .common import Ctx, make_batches, tiny_model

# == parity =============================================================================================
LR = 1e-3


def _train_reference(model: Any, batches: list[dict], steps: int, accum: int, clip: float | None,
                     device: Any, autocast: bool = False) -> tuple[list[float], dict[str, Any]]:
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, first = [], {}
    it = iter(batches)
    ctx = torch.autocast(device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    for s in range(steps):
        for _ in range(accum):
            b = {k: v.to(device) for k, v in next(it).items()}
            with ctx:
                loss = model(**b).loss
            (loss / accum).backward()
            losses.append(float(loss.detach()))
        if s == 0:
            first = {n: p.grad.detach().to("cpu", torch.float32, copy=True) for n, p in model.named_parameters()}
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return losses, first


def _train_reference_mixed(model: Any, batches: list[dict], steps: int, accum: int, clip: float | None,
                           device: Any) -> tuple[list[float], dict[str, Any]]:
    """Plain PyTorch in the engine's mixed-precision scheme: FP32 masters and gradients, every parameter cast
    to bf16 for the forward and backward (the buffers, e.g. rotary tables, stay as they are, as the engine
    keeps them), each micro-batch's bf16 gradients summed into the FP32 gradients, clip and AdamW on the
    masters. The reference a bf16 engine is held to; an FP32 one is held to `_train_reference`."""
    import torch

    work = copy.deepcopy(model)
    masters = list(model.parameters())
    shadows = list(work.parameters())
    opt = torch.optim.AdamW(masters, lr=LR)
    losses, first = [], {}
    it = iter(batches)
    for s in range(steps):
        with torch.no_grad():
            for w, m in zip(shadows, masters):
                w.data = m.detach().to(torch.bfloat16)
        for _ in range(accum):
            b = {k: v.to(device) for k, v in next(it).items()}
            loss = work(**b).loss
            (loss / accum).backward()
            losses.append(float(loss.detach()))
            with torch.no_grad():
                for w, m in zip(shadows, masters):
                    if w.grad is not None:
                        g = w.grad.float()
                        m.grad = g if m.grad is None else m.grad.add_(g)
                        w.grad = None
        if s == 0:
            first = {n: p.grad.detach().to("cpu", torch.float32, copy=True) for n, p in model.named_parameters()}
        if clip:
            torch.nn.utils.clip_grad_norm_(masters, clip)
        opt.step()
        opt.zero_grad()
    return losses, first


def _train_engine(eng: Any, batches: list[dict], steps: int, accum: int, clip: float | None
                  ) -> tuple[list[float], dict[str, Any], list[dict]]:
    losses, first, stats = [], {}, []
    it = iter(batches)
    for s in range(steps):
        eng.reset_stats()
        for _ in range(accum):
            loss = eng(**next(it)).loss
            eng.backward(loss / accum)
            losses.append(float(loss.detach()))
        if s == 0:
            eng.pipeline.synchronize_grads()
            first = {n: p.grad.clone() for n, p in eng.named_parameters() if p.grad is not None}
        if clip:
            eng.clip_grad_norm_(clip)
        eng.step()
        eng.zero_grad()
        stats.append(eng.collect_stats())
    return losses, first, stats


def _grad_rel(ref: dict, eng: dict) -> float:
    worst = 0.0
    for n, g in ref.items():
        worst = max(worst, float((eng[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)))
    return worst


def _param_abs(ref_model: Any, eng: Any) -> float:
    sd = eng.state_dict()
    return max(float((sd[n] - p.detach().float().cpu()).abs().max()) for n, p in ref_model.state_dict().items())


def _param_split(ref_model: Any, eng: Any, first: dict[str, Any], noise_rel: float) -> tuple[float, float, float]:
    """(worst |diff| over entries with a clear first-step gradient, worst over noise-level ones, their share).

    Adam's first update is about lr * sign(g) whatever |g| is, so an entry whose gradient is at the level of
    the two runs' reduction-order difference (|g| <= noise_rel * the tensor's max) may step the other way:
    such entries may differ by up to 2 * lr a step; every other entry must match to the parameter tolerance.
    """
    sd = eng.state_dict()
    signal, noise, n_noise, n_all = 0.0, 0.0, 0, 0
    for n, p in ref_model.state_dict().items():
        diff = (sd[n] - p.detach().float().cpu()).abs()
        g = first.get(n)  # a tied alias has none: all its entries are held to the tight tolerance
        quiet = (g.abs() <= noise_rel * g.abs().max()) if g is not None else diff.new_zeros(diff.shape, dtype=bool)
        if (~quiet).any():
            signal = max(signal, float(diff[~quiet].max()))
        if quiet.any():
            noise = max(noise, float(diff[quiet].max()))
        n_noise += int(quiet.sum())
        n_all += diff.numel()
    return signal, noise, n_noise / max(n_all, 1)


def deterministic(fn: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    """`fn` run with deterministic kernels, for the bit-identical checks: without them a CUDA kernel may sum
    in another order on every call (atomics in the FP32 memory-efficient attention backward, split-K
    GEMMs). CUBLAS_WORKSPACE_CONFIG is set for every phase's process (orchestrate.py)."""
    import torch

    def run() -> dict[str, Any]:
        torch.use_deterministic_algorithms(True, warn_only=True)  # a kernel without one warns, the check then shows it
        try:
            return fn()
        finally:
            torch.use_deterministic_algorithms(False)

    return run


def phase_parity(ctx: Ctx) -> None:
    import torch

    from megatrain.config.schema import EngineConfig
    from megatrain.engine import Engine

    sh = ctx.shapes()
    steps, accum, clip = 5, 2, 0.5
    batches = make_batches(steps * accum, sh)
    # Tolerances: the design's CPU ones, the parameters' applied to entries with a clear gradient (see
    # _param_split); on a GPU the engine and the reference run other kernels (cuBLAS picks per shape,
    # the chunked loss sums in another order), so first-step gradients get 1e-5 relative, not 1e-6.
    tol = {"grad_rel": 1e-5 if ctx.cuda else 1e-6, "loss_abs": 1e-5, "param_abs": 1e-5,
           "param_abs_noise": 2 * LR * steps}
    dev = str(ctx.device)

    def fp32(family: str, tied: bool, **knobs: Any) -> dict[str, Any]:
        base = tiny_model(family, sh, tied=tied)
        ref = copy.deepcopy(base).to(ctx.device)
        eng = Engine(copy.deepcopy(base), EngineConfig(parity_probe=False, device=dev, compute_dtype="float32", loss_chunk_tokens=13,
                                                       **knobs))
        rl, rg = _train_reference(ref, batches, steps, accum, clip, ctx.device)
        el, eg, _ = _train_engine(eng, batches, steps, accum, clip)
        res = {"grad_rel": _grad_rel(rg, eg), "loss_abs": max(abs(a - b) for a, b in zip(rl, el)),
               "tolerance": tol, "steps": steps, "accum": accum, "lr": LR}
        res["param_abs"], res["param_abs_noise"], res["noise_share"] = _param_split(ref, eng, rg, 10 * tol["grad_rel"])
        res["ok"] = all(res[k] <= tol[k] for k in tol) and all(math.isfinite(x) for x in el)
        return res

    ctx.check("fp32_llama", lambda: fp32("llama", False))
    ctx.check("fp32_qwen2_tied", lambda: fp32("qwen2", True))

    def bf16() -> dict[str, Any]:
        base = tiny_model("llama", sh)
        ref32 = copy.deepcopy(base).to(ctx.device)
        refamp = copy.deepcopy(base).to(ctx.device)
        refmix = copy.deepcopy(base).to(ctx.device)
        # The GPU's defaults on every device (the overlap is on by default on CUDA only), with hilo masters.
        eng = Engine(copy.deepcopy(base), EngineConfig(parity_probe=False, device=dev, compute_dtype="bfloat16", trace=True,
                                                      offload_activations=False, optimizer_overlap=True,
                                                      host_master="hilo", residency="stream"))
        rl, _ = _train_reference(ref32, batches, steps, accum, clip, ctx.device)
        al, _ = _train_reference(refamp, batches, steps, accum, clip, ctx.device, autocast=True)
        ml, _ = _train_reference_mixed(refmix, batches, steps, accum, clip, ctx.device)
        el, _, stats = _train_engine(eng, batches, steps, accum, clip)
        loads = sum(1 for r in eng.trace if r.stream == "h2d" and r.kind == "load")  # last step's
        per_layer = eng.store.layers[0].numel
        bytes_per_param = stats[-1]["h2d_bytes"] / (loads * per_layer) if loads else None
        diff = max(abs(a - b) for a, b in zip(rl, el))
        res = {"loss_abs_vs_fp32": diff, "loss_abs_vs_autocast": max(abs(a - b) for a, b in zip(al, el)),
               "autocast_vs_fp32": max(abs(a - b) for a, b in zip(al, rl)),
               "loss_abs_vs_mixed": max(abs(a - b) for a, b in zip(ml, el)),  # the same scheme (sanitizer: held to it)
               "shadow_dtype": str(eng.store.layers[0].shadow.dtype), "streamed_bytes_per_param": bytes_per_param,
               "loads_last_step": loads, "tolerance_vs_fp32": 0.05}
        res["ok"] = (0 < diff <= 0.05 and res["shadow_dtype"] == "torch.bfloat16" and bytes_per_param == 2.0)
        return res

    ctx.check("bf16_llama", bf16)

    def pinned() -> dict[str, Any]:
        # The real registration path: exactly what the preflight counted is page-locked, and nothing else.
        from megatrain.engine.parts import pinned_preflight

        base = tiny_model("llama", sh)
        prefix = "model.layers."
        layers = [[(n, q.shape) for n, q in layer.named_parameters()] for layer in base.model.layers]
        globs = [q.shape for n, q in base.named_parameters() if not n.startswith(prefix)]
        out = {}
        for dtype in ("float32", "bfloat16"):
            eng = Engine(copy.deepcopy(base), EngineConfig(parity_probe=False, device=dev, compute_dtype=dtype, pin_memory=ctx.cuda))
            want = sum(pinned_preflight(layers, globs, getattr(torch, dtype), staging=ctx.cuda).values())
            got = eng.store.pinned_bytes
            src_pinned = all(g.stream_source.is_pinned() for g in eng.store.layers) if ctx.cuda else None
            grads_pinned = any(g.grad.is_pinned() for g in eng.store.groups()) if ctx.cuda else None
            out[dtype] = {"pinned_bytes": got, "preflight_bytes": want if ctx.cuda else 0,
                          "stream_sources_pinned": src_pinned, "grad_slabs_pinned": grads_pinned}
        ok = all(v["pinned_bytes"] == v["preflight_bytes"] for v in out.values())
        if ctx.cuda:
            ok = ok and all(v["stream_sources_pinned"] and not v["grad_slabs_pinned"] for v in out.values())
        return {"ok": ok, **out}

    ctx.check("pinned_bytes_exact", pinned)

    def offload() -> dict[str, Any]:
        base = tiny_model("llama", sh)
        res_eng = Engine(copy.deepcopy(base), EngineConfig(parity_probe=False, device=dev, offload_activations=False))
        off_eng = Engine(copy.deepcopy(base), EngineConfig(parity_probe=False, device=dev, offload_activations=True))
        rl, rg, rs = _train_engine(res_eng, batches[:4], 2, 2, None)
        ol, og, os_ = _train_engine(off_eng, batches[:4], 2, 2, None)
        diff = max(abs(a - b) for a, b in zip(rl, ol))
        grad = _grad_rel(rg, og)
        limit = 0.0  # the same kernels on the same values in the same order: bit-identical
        return {"ok": diff <= limit and grad <= max(limit, 1e-12) and
                os_[-1]["peak_activation_bytes"] < rs[-1]["peak_activation_bytes"],
                "loss_abs": diff, "grad_rel": grad, "peak_activation_bytes": [rs[-1]["peak_activation_bytes"],
                                                                            os_[-1]["peak_activation_bytes"]]}

    ctx.check("offload_activations", deterministic(offload))

    def overlap() -> dict[str, Any]:
        # The host optimizer a layer at a time behind the next forward: the same kernels in the same order
        # on the device, so bit-identical to the whole step here too.
        base = tiny_model("llama", sh)
        whole = Engine(copy.deepcopy(base), EngineConfig(parity_probe=False, device=dev, optimizer_overlap=False))
        over = Engine(copy.deepcopy(base), EngineConfig(parity_probe=False, device=dev, optimizer_overlap=True))
        wl, _, _ = _train_engine(whole, batches, steps, accum, clip)
        ol, _, _ = _train_engine(over, batches, steps, accum, clip)
        sw, so = whole.state_dict(), over.state_dict()
        worst = max((sw[k] - so[k]).abs().max().item() for k in sw)
        return {"ok": wl == ol and worst == 0.0 and over._layered is not None, "losses_equal": wl == ol,
                "param_abs": worst}

    ctx.check("optimizer_overlap", deterministic(overlap))

    def residency() -> dict[str, Any]:
        # Layers kept on the device (weights in buffers of their own, forward graphs kept, or with their saved
        # activations in host memory): the same kernels on the same values in the same order as streaming with
        # recompute, so bit-identical, with fewer copies. Layers
        # whose optimizer is on the device too ("optimizer", and what "auto" fills on a GPU) take torch's device
        # AdamW instead of the host kernel: the same arithmetic, FP32 rounding apart (docs/HOST_MODES.md), so
        # within the FP32 parity tolerance of the streamed run, with no gradient copied down for them.
        base = tiny_model("llama", sh)
        runs = {}
        for name, setting in (("stream", "stream"), ("some", {"weights": 2, "activations": 1}),
                              ("offloaded", {"weights": 2, "activations": 2, "offload": 1}),
                              ("optimizer", {"weights": 2, "activations": 1, "optimizer": 2}), ("auto", "auto")):
            eng = Engine(copy.deepcopy(base), EngineConfig(parity_probe=False, device=dev, residency=setting))
            losses, _, stats = _train_engine(eng, batches, steps, accum, clip)
            runs[name] = (losses, eng.state_dict(), stats[-1])
        ref_l, ref_p, ref_s = runs["stream"]

        def worst(names: tuple[str, ...]) -> float:
            return max((runs[n][1][k].float() - ref_p[k].float()).abs().max().item() for n in names for k in ref_p)

        exact, near = worst(("some", "offloaded")), worst(("optimizer", "auto"))
        loss_abs = max(abs(a - b) for n in ("optimizer", "auto") for a, b in zip(runs[n][0], ref_l))
        auto, opt = runs["auto"][2], runs["optimizer"][2]
        offloaded = runs["offloaded"][2]
        return {"ok": runs["some"][0] == ref_l == runs["offloaded"][0] and exact == 0.0 and near <= 1e-5
                and loss_abs <= 1e-5 and offloaded["offloaded_graph_bytes"] > 0
                and auto["h2d_bytes"] < ref_s["h2d_bytes"] and auto["recomputed_layers"] < ref_s["recomputed_layers"]
                and opt["d2h_bytes"] < ref_s["d2h_bytes"],
                "param_abs_kept": exact, "param_abs_optimizer": near, "loss_abs_optimizer": loss_abs,
                "h2d_bytes": {n: r[2]["h2d_bytes"] for n, r in runs.items()},
                "d2h_bytes": {n: r[2]["d2h_bytes"] for n, r in runs.items()},
                "recomputed_layers": {n: r[2]["recomputed_layers"] for n, r in runs.items()},
                "auto_kept": [auto["resident_weight_layers"], auto["kept_graph_layers"]],
                "offloaded_graph_bytes": offloaded["offloaded_graph_bytes"]}

    ctx.check("residency", deterministic(residency))
    for k in (1, 3):
        ctx.check(f"num_buffers_{k}", lambda k=k: fp32("llama", False, num_buffers=k))
