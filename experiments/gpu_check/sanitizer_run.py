"""The sanitizer phase's own process: `python -m experiments.gpu_check.sanitizer_run --device cuda`, started
with TORCH_CUDA_SANITIZER=1 (see sanitizer.py); prints one JSON line.

It runs the configuration a GPU user gets (bf16 compute, the optimizer overlapped, hilo masters) on every
device, the CPU's dry run included, so a bug of that configuration shows in CI; the same with the overlap
off (every copy then queued by the launching thread); and FP32 compute. Each is held to the reference of
its own arithmetic: bf16 compute to plain PyTorch in the same mixed-precision scheme (parity.py,
`_train_reference_mixed`) at a tolerance measured in the same run, FP32 to plain FP32 PyTorch at 1e-5.
The sanitizer (or, on the CPU, an op counter in its place) covers every thread the engine starts
(every_thread.py): with the overlap on, most layer loads are queued by the copy stream's deferred thread.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import sys
import threading
from collections import Counter
from typing import Any

from .common import Shapes, make_batches, tiny_model
from .every_thread import every_thread
from .parity import _train_engine, _train_reference, _train_reference_mixed

FP32_TOL = 1e-5  # the parity phase's per-step loss tolerance in FP32
# The suite's bf16 tolerance (tests/gpu_defaults.py, FLOOR_FACTOR): the reference's own bf16 floor is how far it
# moves when only its attention kernel changes, and an engine run is held to twice that (one floor from one kernel
# is at most two from the other). Measured there, the engine sits at up to 1.14 floors on the pre-clip norms and
# 1.26 on the largest single loss difference: 1x would fail a correct engine.
FLOOR_FACTOR = 2.0
# Where the layers live (EngineConfig fields): every layer streamed (ring reuse, recompute, the freed and loaded
# events on every layer) with offloaded activations, so both side streams are busy; and a partial placement that
# keeps the first layer's weights and graph while the others stream, so kept buffers and the ring work side by
# side (its activations stay on the device: offloaded ones are never kept). Never "auto": on a large device it
# keeps every layer of these tiny models, and the streamed path would go unchecked.
PLACEMENTS: dict[str, dict[str, Any]] = {
    "stream": {"residency": "stream", "offload_activations": True},
    "partial": {"residency": {"weights": 1, "activations": 1}, "offload_activations": False},
}
# The configurations, by name: EngineConfig fields beyond the shared ones (a small loss chunk, so the chunked
# head is busy) and the placement's.
RUNS: dict[str, dict[str, Any]] = {
    "gpu_defaults": {"compute_dtype": "bfloat16", "optimizer_overlap": True, "host_master": "hilo"},
    "gpu_defaults_overlap_off": {"compute_dtype": "bfloat16", "optimizer_overlap": False, "host_master": "hilo"},
    "fp32": {"compute_dtype": "float32", "optimizer_overlap": True},
}


def compare(engine: list[float], reference: list[float], tol: float) -> dict[str, Any]:
    """Per-step losses of the engine against a reference, at `tol` (absolute)."""
    worst = max(abs(a - b) for a, b in zip(engine, reference, strict=True))
    return {"loss_abs": worst, "tolerance": tol, "ok": worst <= tol}


def bf16_tolerance(model: Any, batches: list[dict], steps: int, accum: int, device: Any,
                   reference: list[float]) -> tuple[float, float]:
    """(tolerance, floor) for bf16 compute, as the suite measures it (tests/gpu_defaults.py): the floor is how far
    the mixed-precision reference (sdpa's own kernel choice) moves when only its attention kernel changes to
    sdpa's math kernel (the same maths, other roundings), the bf16 noise two correct programs differ by; the
    tolerance is FLOOR_FACTOR floors, and never below FP32's. (Eager attention is no such pair: it treats padded
    query rows differently from sdpa.)"""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        other, _ = _train_reference_mixed(copy.deepcopy(model), batches, steps, accum, None, device)
    floor = max(abs(a - b) for a, b in zip(reference, other))
    return max(FLOOR_FACTOR * floor, FP32_TOL), floor


def _counting_mode() -> Any:
    """On the CPU, where the sanitizer does not exist: a dispatch mode that only counts, so the dry run still
    exercises the per-thread coverage the sanitizer gets on CUDA."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            return func(*args, **(kwargs or {}))

    return Count()


def run_name(config: str, placement: str) -> str:
    """`gpu_defaults` (streamed), `gpu_defaults, partial`: the stream runs keep the configurations' names."""
    return config if placement == "stream" else f"{config}, {placement}"


def run_all(device: Any, shared_mode: Any, runs: dict[str, dict[str, Any]] = RUNS,
            placements: dict[str, Any] = PLACEMENTS) -> dict[str, Any]:
    """Every configuration in `runs` at every placement, against its reference, the engines' threads under
    `shared_mode`."""
    from megatrain.config import EngineConfig
    from megatrain.engine import Engine

    sh = Shapes(64, 3, 256, 32, 2)  # every CUDA call is checked on the host: keep it small
    steps, accum = 2, 2
    batches = make_batches(steps * accum, sh)
    base = tiny_model("llama", sh)
    fp32_ref, _ = _train_reference(copy.deepcopy(base).to(device), batches, steps, accum, None, device)
    mixed_ref, _ = _train_reference_mixed(copy.deepcopy(base).to(device), batches, steps, accum, None, device)
    tol16, floor16 = bf16_tolerance(copy.deepcopy(base).to(device), batches, steps, accum, device, mixed_ref)
    out: dict[str, Any] = {"bf16_floor": floor16, "references": {"fp32": fp32_ref, "bf16 mixed precision": mixed_ref}}
    for (name, knobs), (where, place) in itertools.product(runs.items(), placements.items()):
        bf16 = knobs["compute_dtype"] == "bfloat16"
        residency = place["residency"]
        with every_thread(shared_mode) as seen:
            eng = Engine(copy.deepcopy(base), EngineConfig(parity_probe=False, device=str(device), loss_chunk_tokens=13, **place, **knobs))
            losses, _, stats = _train_engine(eng, batches, steps, accum, None)
            eng.synchronize()
        res = compare(losses, mixed_ref if bf16 else fp32_ref, tol16 if bf16 else FP32_TOL)
        kept = [stats[-1]["resident_weight_layers"], stats[-1]["kept_graph_layers"]]
        res.update(reference="bf16 mixed precision" if bf16 else "fp32", config=knobs, placement=place,
                   kept_weights_graphs=kept, recomputed_layers=stats[-1]["recomputed_layers"], losses=losses,
                   threads_checked=dict(Counter({k: v for k, v in seen.items() if k != threading.main_thread().name})))
        # The placement the run was meant to check: some layers streamed (and recomputed) in both, some kept in one.
        res["placement_ok"] = placement_ok(residency, kept, stats[-1]["recomputed_layers"], sh.layers)
        res["ok"] = res["ok"] and res["placement_ok"]
        if knobs.get("optimizer_overlap"):
            # The point of the coverage: ops from the engine's own threads reached the checker.
            res["ok"] = res["ok"] and any(k.startswith("megatrain-") for k in res["threads_checked"])
        out[run_name(name, where)] = res
    return out


def placement_ok(residency: Any, kept: list[int], recomputed: int, layers: int) -> bool:
    """Whether a run's placement is the one asked for: "stream" keeps nothing and recomputes every layer; counts
    keep exactly those layers and still stream (and recompute) the rest."""
    if residency == "stream":
        want = [0, 0]
    else:
        want = [residency["weights"], residency["activations"]]
    return kept == want and recomputed > 0 and want[0] < layers


def main(argv: list[str] | None = None) -> int:
    import argparse

    import torch

    ap = argparse.ArgumentParser(prog="python -m experiments.gpu_check.sanitizer_run")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    from torch.cuda import _sanitizer

    on = _sanitizer.cuda_sanitizer is not None and _sanitizer.cuda_sanitizer.enabled
    if on:
        shared, ctx = _sanitizer.cuda_sanitizer.dispatch, contextlib.nullcontext()
    else:
        shared = _counting_mode()
        ctx = shared
    with ctx:
        runs = run_all(dev, shared)
    names = {run_name(c, p) for c in RUNS for p in PLACEMENTS}
    results = {k: v for k, v in runs.items() if k in names}
    print(json.dumps({"sanitizer": on, "runs": results, "bf16_floor": runs["bf16_floor"],
                      "references": runs["references"], "loss_abs": max(r["loss_abs"] for r in results.values()),
                      "parity_ok": all(r["ok"] for r in results.values()), "steps": 2, "device": str(dev)},
                     default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
