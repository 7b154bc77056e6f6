"""Phase stress: slowed copy and compute streams must not change results; a removed wait must be caught."""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

from .common import Ctx, _sync, make_batches, tiny_model
from .parity import _grad_rel, _train_engine

# The races under test are the streaming ring's (a layer's buffer reused, its copy waited for): every layer streams.
STREAM = {"residency": "stream"}


def _cuda_sleeper(ms: float) -> Callable[[], None]:
    """A spin kernel of about `ms` on the current stream: a slow copy or compute engine, on demand."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    cycles = int(10_000_000 / start.elapsed_time(end) * ms)
    return lambda: torch.cuda._sleep(cycles)


def slow_copies(eng: Any, stream: str, ms: float, kinds: tuple[str, ...]) -> None:
    cs = getattr(eng.streams, stream)
    if not cs._cuda:
        cs.stall_s = ms / 1e3
        return
    sleep = _cuda_sleeper(ms)
    orig = cs.submit

    def submit(fn: Callable[[], int], after: Any, kind: str, layer: int) -> Any:
        if kind not in kinds:
            return orig(fn, after, kind, layer)

        def slow() -> int:
            sleep()  # queued on the copy stream: submit runs `fn` inside it
            return fn()

        return orig(slow, after, kind, layer)

    cs.submit = submit


def slow_compute(eng: Any, ms: float) -> None:
    sleep = _cuda_sleeper(ms) if eng.device.type == "cuda" else (lambda: time.sleep(ms / 1e3))
    orig = eng.templates.call

    def call(i: int, w: Any, h: Any, *rest: Any) -> Any:
        sleep()
        return orig(i, w, h, *rest)

    eng.templates.call = call


def phase_stress(ctx: Ctx) -> None:
    import torch

    if ctx.cuda:
        was = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
        torch.use_deterministic_algorithms(True, warn_only=True)  # so equal means equal, not "close"
        try:
            _stress(ctx)
        finally:
            torch.use_deterministic_algorithms(was[0], warn_only=was[1])
    else:
        _stress(ctx)


def _stress(ctx: Ctx) -> None:
    import torch

    from megatrain.config.schema import EngineConfig
    from megatrain.engine import Engine
    from megatrain.engine.parts import DONE, Streams

    sh = ctx.shapes()
    base = tiny_model("llama", sh, seed=3)
    batches = make_batches(2, sh, seed=4)
    dev = str(ctx.device)
    ms = 5.0 if ctx.cuda else 2.0

    def run(knobs: dict | None = None, setup: Callable[[Any], None] | None = None,
            nan_buffers: bool = False) -> dict[str, Any]:
        eng = Engine(copy.deepcopy(base), EngineConfig(parity_probe=False, device=dev, **STREAM, **(knobs or {})))
        if setup is not None:
            setup(eng)
        if nan_buffers:
            for b in eng.pipeline.buffers:
                b.fill_(float("nan"))
        try:
            losses, grads, _ = _train_engine(eng, batches, 2, 1, None)
        except Exception as exc:  # noqa: BLE001 - autograd may see a buffer overwritten, the guard NaN steps
            return {"error": f"{type(exc).__name__}: {exc}"[:200]}
        finally:
            eng.streams.synchronize()
        return {"losses": losses, "grads": grads, "params": eng.state_dict()}

    reference = run()

    def same(out: dict[str, Any]) -> dict[str, Any]:
        if "error" in out:
            return {"ok": False, "error": out["error"]}
        loss = max(abs(a - b) for a, b in zip(reference["losses"], out["losses"]))
        grad = _grad_rel(reference["grads"], out["grads"])
        param = max(float((reference["params"][n] - p).abs().max()) for n, p in out["params"].items())
        finite = all(math.isfinite(x) for x in out["losses"])
        return {"ok": finite and loss <= 1e-6 and grad <= 1e-6 and param <= 1e-6, "loss_abs": loss,
                "grad_rel": grad, "param_abs": param, "bitwise": loss == 0 and grad == 0 and param == 0}

    ctx.check("slow_h2d", lambda: same(run(setup=lambda e: slow_copies(e, "h2d", ms, ("load",)))))
    ctx.check("slow_d2h", lambda: same(run(setup=lambda e: slow_copies(e, "d2h", ms, ("grad", "act-out")))))
    ctx.check("slow_compute_offloaded_activations",
              lambda: same(run({"offload_activations": True}, setup=lambda e: slow_compute(e, ms))))
    ctx.check("slow_everything_offloaded", lambda: same(run(
        {"offload_activations": True, "num_buffers": 3},
        setup=lambda e: (slow_compute(e, ms / 2), slow_copies(e, "h2d", ms, ("load", "act-in")),
                         slow_copies(e, "d2h", ms, ("grad", "act-out"))))))

    def missing_wait_is_caught() -> dict[str, Any]:
        # Negative control: with the compute stream's wait on each load removed, a slowed link must show.
        orig = Streams.wait
        Streams.wait = lambda self, event, what: None
        try:
            out = run(setup=lambda e: slow_copies(e, "h2d", ms * 4, ("load",)), nan_buffers=True)
        finally:
            Streams.wait = orig
        caught = "error" in out or not same(out)["ok"]
        return {"ok": caught, "caught": caught}

    ctx.check("missing_wait_is_caught", missing_wait_is_caught)

    if ctx.cuda:
        def without_record_stream() -> dict[str, Any]:
            # Informational: whether this GPU reproduces the race record_stream prevents (slow d2h, so the
            # allocator would hand a gradient's memory to the next layer mid-copy).
            orig = torch.Tensor.record_stream
            torch.Tensor.record_stream = lambda self, stream: None
            try:
                out = run(setup=lambda e: slow_copies(e, "d2h", ms * 4, ("grad",)))
            finally:
                torch.Tensor.record_stream = orig
            return {"ok": True, "race_reproduced": "error" in out or not same(out)["ok"]}

        def without_prefetch_fence() -> dict[str, Any]:
            # Informational: the activation prefetch without its wait on queued compute.
            from megatrain.engine.parts import ActivationStore

            orig = ActivationStore.prefetch

            def prefetch(self: Any, layer: int) -> None:
                real = self.streams.record_compute
                self.streams.record_compute = lambda: DONE
                try:
                    orig(self, layer)
                finally:
                    self.streams.record_compute = real

            ActivationStore.prefetch = prefetch
            try:
                out = run({"offload_activations": True}, setup=lambda e: slow_compute(e, ms * 2))
            finally:
                ActivationStore.prefetch = orig
            return {"ok": True, "race_reproduced": "error" in out or not same(out)["ok"]}

        ctx.check("control_without_record_stream", without_record_stream)
        ctx.check("control_without_prefetch_fence", without_prefetch_fence)

    def host_runs_ahead() -> dict[str, Any]:
        # Non-blocking copies from pinned memory: queuing the forward's loads must not wait for them.
        if not ctx.cuda:
            return {"ok": True, "note": "on the CPU the host is the compute engine"}
        # Only the copy path is under test here: attention that syncs per layer (the sync phase reports
        # that) would hold the host back too.
        knobs = {"segment_attention": False} if "segment_attention" in EngineConfig.__dataclass_fields__ else {}
        eng = Engine(copy.deepcopy(base), EngineConfig(parity_probe=False, device=dev, **STREAM, **knobs))
        slow_copies(eng, "h2d", ms * 4, ("load",))
        orig = eng.pipeline.forward
        spent: list[float] = []

        def fwd(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                spent.append(time.perf_counter() - t0)

        eng.pipeline.forward = fwd
        _sync(ctx.device)
        eng(**batches[0])
        _sync(ctx.device)
        device_s = sh.layers * ms * 4 / 1e3
        return {"ok": spent[0] < 0.5 * device_s, "host_loop_s": spent[0], "queued_copy_time_s": device_s}

    ctx.check("host_runs_ahead_of_copies", host_runs_ahead)

    def device_timeline() -> dict[str, Any]:
        # On CUDA the trace and the stats must be device time: a slowed link shows as compute waiting.
        eng = Engine(copy.deepcopy(base), EngineConfig(parity_probe=False, device=dev, trace=True, **STREAM))
        slow_copies(eng, "h2d", ms, ("load",))
        _train_engine(eng, batches[:1], 1, 1, None)
        st = eng.collect_stats()
        recs = eng.trace
        kinds = sorted({(r.stream, r.kind) for r in recs})
        loads = [r for r in recs if r.stream == "h2d"]
        load_s = statistics.median(r.t_end - r.t_start for r in loads) if loads else 0.0
        res = {"copy_wait_s": st["copy_wait_s"], "h2d_busy_s": st["h2d_busy_s"], "d2h_busy_s": st["d2h_busy_s"],
               "median_load_s": load_s, "stream_kinds": kinds, "records": len(recs)}
        res["ok"] = (("compute", "fwd") in kinds and ("h2d", "load") in kinds and ("d2h", "grad") in kinds
                     and st["h2d_busy_s"] > 0 and (load_s >= ms / 1e3 * 0.8 or not ctx.cuda)
                     and (st["copy_wait_s"] > 0 or not ctx.cuda))
        return res

    ctx.check("device_timeline", device_timeline)


# == bench ===============================================================================================
