"""The CUDA path, proven: one prepared check that validates and measures MegaTrain on a machine with a GPU.

    bash experiments/gpu_check.sh                 # on the GPU machine, from the repository root
    python -m experiments.gpu_check --dry-run     # the same script on the CPU with tiny shapes (CI runs it)
    bash scripts/fetch_wheels.sh                  # only for a GPU machine without network: wheels/ to copy along

Set OUT=<folder> to have the summary files copied there after every phase; prefix MEGATRAIN_GIT_COMMIT=<sha>
to record the commit when the copy of the tree on the GPU machine has no .git.

Phases, in order, each with its own time budget, in a child process that the parent kills when a phase
overruns and replaces when it dies (and after a phase that raised on a GPU, whose CUDA context may be
poisoned): a hang or a crash costs that phase only. The parent publishes the summary after every phase.

- env        what ran where: GPU, driver, PCIe link, torch/CUDA, packages, host memory, pinning, compilers
- bandwidth  pinned and pageable host<->device copies timed with CUDA events, both directions at once,
             the engine's own copy stream, and the bf16/fp32 matmul rate (the link and compute ceilings)
- ds_build   DeepSpeed's CPU Adam compiled in the background while the correctness phases run
- parity     engine vs plain PyTorch on the device: FP32 (Llama, tied Qwen2), bf16, offloaded
             activations, the overlapped optimizer (bit-identical to the whole step), 1 and 3 device buffers
- sync       no synchronizing CUDA call inside the per-layer loop (torch.cuda.set_sync_debug_mode), with
             a planted `.item()` that must be caught; pinned buffers and side streams in use
- stress     slowed copy and compute streams must not change results (stream waits, record_stream, the
             allocator's reuse of activation memory); a removed wait must be caught; the host must run
             ahead of delayed copies (non-blocking copies from pinned memory)
- bench      megatrain vs DeepSpeed ZeRO-3 CPU offload through the harness (same model, batch and
             recompute; CSV rows with provenance, per-step timeline traces), then a context sweep

Outputs, in --out: phases/<phase>.json (written as each check finishes), results.csv, traces/, logs/,
summary.json and summary.md; with --bundle (default: $OUT) at most 6 files are copied there after every
phase (a small, fixed set that is quick to copy back): summary.md, summary.json, results.csv, timeline.json
(the largest megatrain point's step), gpu_check.tar.gz (everything), and the wrapper's log.txt. The
summary table is printed last.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import glob
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
SWEEP_NAME = "gpu_check"


# -- phases and budgets ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PhaseSpec:
    name: str
    budget_s: float  # on the GPU
    dry_budget_s: float  # in --dry-run


PHASES = [
    PhaseSpec("env", 30, 30),
    PhaseSpec("bandwidth", 45, 20),
    PhaseSpec("parity", 75, 60),
    PhaseSpec("sync", 45, 40),
    PhaseSpec("stress", 60, 40),
    PhaseSpec("bench", 330, 200),  # capped by what is left of the whole budget
]
DS_BUILD = PhaseSpec("ds_build", 240, 25)  # runs beside parity/sync/stress
TOTAL_BUDGET_S = 450.0  # from the wrapper's start (wheel install included): < 8 min on the device
DRY_TOTAL_BUDGET_S = 300.0  # a cap for slow CI machines; ~1 min on an idle 2-core one
SUMMARY_RESERVE_S = 12.0


# -- small shapes for the correctness phases ---------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Shapes:
    hidden: int
    layers: int
    vocab: int
    seq: int
    batch: int


SHAPES = {  # (phase, on_gpu) -> shapes; the CPU ones are the test suite's
    ("parity", False): Shapes(64, 3, 256, 24, 2),
    ("parity", True): Shapes(128, 4, 512, 64, 2),
    ("sync", False): Shapes(64, 3, 256, 32, 2),
    ("sync", True): Shapes(256, 4, 1024, 128, 2),
    ("stress", False): Shapes(64, 4, 256, 32, 2),
    ("stress", True): Shapes(512, 6, 1024, 256, 2),
}


def tiny_model(family: str, sh: Shapes, seed: int = 0, tied: bool = False) -> Any:
    import torch
    import transformers

    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family]
    cfg = cls(hidden_size=sh.hidden, intermediate_size=sh.hidden * 11 // 4, num_hidden_layers=sh.layers,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=sh.vocab, max_position_embeddings=2048,
              tie_word_embeddings=tied)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def make_batches(n: int, sh: Shapes, seed: int = 1) -> list[dict[str, Any]]:
    """Left-padded second row, -100 labels on padding and on a few random tokens (as the tests do)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, sh.vocab, (sh.batch, sh.seq), generator=g)
        mask = torch.ones_like(ids)
        if sh.batch > 1:
            mask[1, : sh.seq // 4] = 0
        labels = ids.clone()
        labels[mask == 0] = -100
        labels[0, torch.randint(0, sh.seq, (3,), generator=g)] = -100
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


# -- per-phase context ---------------------------------------------------------------------------------
class Ctx:
    """What a phase function gets: where to run, which shapes, and a recorder that writes each check's
    result the moment it is known (a phase killed at its deadline keeps what it finished)."""

    def __init__(self, phase: str, out: Path, dry: bool, deadline: float, zero3: str) -> None:
        import torch

        self.phase = phase
        self.out = out
        self.dry = dry
        self.deadline = deadline
        self.zero3 = zero3
        self.cuda = not dry and torch.cuda.is_available()
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.file = out / "phases" / f"{phase}.json"
        self.started = time.time()
        self.data: dict[str, Any] = {"phase": phase, "status": "running", "device": str(self.device),
                                     "started": self.started, "deadline": deadline,
                                     "budget_s": round(deadline - self.started, 1),
                                     "checks": {}}
        self._write()

    def shapes(self, phase: str | None = None) -> Shapes:
        return SHAPES[(phase or self.phase, self.cuda)]

    def _write(self) -> None:
        _atomic_write(self.file, json.dumps(self.data, indent=1, default=_json_default))

    def check(self, name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Run one check; its dict must say `ok`. An exception fails this check, not the phase."""
        t0 = time.perf_counter()
        try:
            res = fn()
        except Exception as exc:  # noqa: BLE001 - recorded, and the next check still runs
            res = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:600],
                   "traceback": traceback.format_exc()[-3000:]}
        res["wall_s"] = round(time.perf_counter() - t0, 3)
        self.data["checks"][name] = res
        self._write()
        _log(f"  {self.phase}.{name}: {'ok' if res.get('ok') else 'FAILED'} ({res['wall_s']:.1f} s)"
             + (f" {res['error']}" if res.get("error") else ""))
        return res

    def info(self, **kw: Any) -> None:
        self.data.setdefault("info", {}).update(kw)
        self._write()

    def finish(self) -> None:
        checks = self.data["checks"].values()
        self.data["status"] = "ok" if all(c.get("ok") for c in checks) else "failed"
        self.data["wall_s"] = round(time.time() - self.started, 1)
        self._write()


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    return str(o)


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


_T0 = float(os.environ.get("GPU_CHECK_T0", time.time()))


def _log(msg: str) -> None:
    print(f"[{time.time() - _T0:6.1f}s] {msg}", flush=True)


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# == env ==============================================================================================
def phase_env(ctx: Ctx) -> None:
    import importlib.metadata as md
    import platform
    import resource

    import torch

    def packages() -> dict[str, Any]:
        vers = {}
        for name in ("torch", "transformers", "accelerate", "deepspeed", "safetensors", "numpy", "pandas",
                     "huggingface-hub", "tokenizers", "pydantic", "nvidia-ml-py", "ninja", "psutil"):
            try:
                vers[name] = md.version(name)
            except md.PackageNotFoundError:
                vers[name] = None
        missing = [n for n in ("transformers", "accelerate", "safetensors", "pyyaml", "pandas", "psutil")
                   if _missing(n)]
        return {"ok": not missing, "python": platform.python_version(), "executable": sys.executable,
                "versions": vers, "missing": missing, "deepspeed_installed": vers["deepspeed"] is not None}

    def device() -> dict[str, Any]:
        res: dict[str, Any] = {"ok": True, "torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
                               "torch_cuda": torch.version.cuda, "device": str(ctx.device)}
        if ctx.cuda:
            props = torch.cuda.get_device_properties(0)
            free, total = torch.cuda.mem_get_info()
            res.update(name=props.name, capability=f"{props.major}.{props.minor}",
                       multiprocessors=props.multi_processor_count, memory_total_bytes=total,
                       memory_free_bytes=free)
            res["nvidia_smi"] = _run_text(["nvidia-smi", "--query-gpu=name,driver_version,pcie.link.gen.current,"
                                           "pcie.link.gen.max,pcie.link.width.current,clocks.sm,clocks.mem",
                                           "--format=csv"])
        elif not ctx.dry:
            res.update(ok=False, error="no CUDA device: run with --dry-run on a CPU machine")
        return res

    def host() -> dict[str, Any]:
        import psutil

        vm = psutil.virtual_memory()
        soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        res: dict[str, Any] = {"ok": True, "cpus": os.cpu_count(), "mem_total_bytes": vm.total,
                               "mem_available_bytes": vm.available, "memlock_soft": soft, "memlock_hard": hard}
        try:
            from megatrain.engine.preflight import available_host_bytes

            res["engine_sees_available_bytes"] = available_host_bytes()
        except Exception as exc:  # noqa: BLE001
            res["engine_sees_available_bytes"] = f"error: {exc}"
        if ctx.cuda:
            t0 = time.perf_counter()
            buf = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
            res["pin_1gib_s"] = round(time.perf_counter() - t0, 3)
            res["pinned"] = bool(buf.is_pinned())
            res["ok"] = res["pinned"]
            del buf
        return res

    def toolchain() -> dict[str, Any]:
        import sysconfig

        header = Path(sysconfig.get_paths()["include"]) / "Python.h"
        gxx = shutil.which("g++") or shutil.which("c++")
        res = {"python_h": header.exists(), "gxx": gxx and _run_text([gxx, "--version"]).splitlines()[0],
               "nvcc": (_run_text(["nvcc", "--version"]).splitlines() or [""])[-1],
               "ninja": shutil.which("ninja"), "torch_extensions_dir": os.environ.get("TORCH_EXTENSIONS_DIR")}
        # DeepSpeed builds CPU Adam at run time: without these ZeRO-3 offload cannot run here.
        res["ok"] = bool(res["python_h"] and res["gxx"] and res["ninja"]) or ctx.dry
        return res

    def code() -> dict[str, Any]:
        from megatrain.metrics.provenance import git_commit

        commit, dirty = git_commit(REPO_ROOT)
        from_git = (REPO_ROOT / ".git").exists()
        return {"ok": True, "git_commit": commit, "git_dirty": dirty,
                "commit_from": "git" if from_git else "MEGATRAIN_GIT_COMMIT"}

    for name, fn in (("packages", packages), ("device", device), ("host", host), ("toolchain", toolchain),
                     ("code", code)):
        ctx.check(name, fn)


def _missing(dist: str) -> bool:
    import importlib.metadata as md

    try:
        md.version(dist)
        return False
    except md.PackageNotFoundError:
        return True


def _run_text(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unavailable: {exc}"


# == bandwidth ==========================================================================================
def _timed_copies(dst: Any, src: Any, reps: int, stream: Any) -> list[float]:
    """Seconds per copy, from CUDA events around each one (after one warm-up copy)."""
    import torch

    times = []
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    return times


def phase_bandwidth(ctx: Ctx) -> None:
    import torch

    if not ctx.cuda:
        def memcpy() -> dict[str, Any]:
            src = torch.ones(16 << 20, dtype=torch.uint8)
            dst = torch.empty_like(src)
            best = 0.0
            for _ in range(5):
                t0 = time.perf_counter()
                dst.copy_(src)
                best = max(best, src.numel() / (time.perf_counter() - t0) / 1e9)
            return {"ok": best > 0, "memcpy_gbps": best, "note": "no link on the CPU: host memcpy rate"}

        ctx.check("memcpy", memcpy)
        ctx.check("matmul", lambda: _matmul_rates(ctx, n_bf16=256, n_fp32=256, reps=3))
        return

    sizes = [16 << 20, 64 << 20, 256 << 20, 1 << 30]
    buf = {"host": torch.empty(sizes[-1], dtype=torch.uint8, pin_memory=True),
           "host2": torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True),
           "dev": torch.empty(sizes[-1], dtype=torch.uint8, device=ctx.device),
           "dev2": torch.empty(256 << 20, dtype=torch.uint8, device=ctx.device)}
    host, host2, dev, dev2 = buf["host"], buf["host2"], buf["dev"], buf["dev2"]
    host.fill_(1)
    side = torch.cuda.Stream()

    def pinned() -> dict[str, Any]:
        res: dict[str, Any] = {"sizes_bytes": sizes, "h2d_gbps": {}, "d2h_gbps": {}}
        for n in sizes:
            h2d = _timed_copies(dev[:n], host[:n], 5, side)
            d2h = _timed_copies(host[:n], dev[:n], 5, side)
            res["h2d_gbps"][str(n)] = {"best": n / min(h2d) / 1e9, "median": n / statistics.median(h2d) / 1e9}
            res["d2h_gbps"][str(n)] = {"best": n / min(d2h) / 1e9, "median": n / statistics.median(d2h) / 1e9}
        res["h2d_peak_gbps"] = max(v["best"] for v in res["h2d_gbps"].values())
        res["d2h_peak_gbps"] = max(v["best"] for v in res["d2h_gbps"].values())
        res["ok"] = res["h2d_peak_gbps"] > 1 and res["d2h_peak_gbps"] > 1
        return res

    def pageable() -> dict[str, Any]:
        n = 256 << 20
        src = torch.ones(n, dtype=torch.uint8)  # not pinned: the fallback when pinning fails
        h2d = _timed_copies(dev[:n], src, 3, side)
        d2h = _timed_copies(src, dev[:n], 3, side)
        return {"ok": True, "bytes": n, "h2d_gbps": n / min(h2d) / 1e9, "d2h_gbps": n / min(d2h) / 1e9}

    def bidirectional() -> dict[str, Any]:
        # The engine's backward streams weights in and gradients out at once.
        n = 256 << 20
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        best = 0.0
        for _ in range(4):
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            e1, e2 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(s1)
            s2.wait_event(start)
            with torch.cuda.stream(s1):
                dev[:n].copy_(host[:n], non_blocking=True)
                e1.record(s1)
            with torch.cuda.stream(s2):
                host2.copy_(dev2, non_blocking=True)
                e2.record(s2)
            torch.cuda.synchronize()
            sec = max(start.elapsed_time(e1), start.elapsed_time(e2)) / 1e3
            best = max(best, 2 * n / sec / 1e9)
        return {"ok": best > 1, "bytes_each_way": n, "aggregate_gbps": best}

    def engine_stream() -> dict[str, Any]:
        # The engine's own copy stream and its event-based busy time: what the results' h2d_gbps_busy uses.
        from megatrain.engine.stream import DONE, CopyStream, Trace

        cs = CopyStream("h2d", ctx.device, Trace(False, ctx.device))
        n, jobs = 128 << 20, 16

        def job(i: int) -> Callable[[], int]:
            def fn() -> int:
                dev[(i % 4) * n: (i % 4 + 1) * n].copy_(host[(i % 4) * n: (i % 4 + 1) * n], non_blocking=True)
                return n
            return fn

        for i in range(jobs):  # warm-up
            cs.submit(job(i), DONE, "load", i)
        cs.reset_counters()
        t0 = time.perf_counter()
        for i in range(jobs):
            cs.submit(job(i), DONE, "load", i)
        enqueue_s = time.perf_counter() - t0
        cs.synchronize()
        wall = time.perf_counter() - t0
        busy = cs.busy_s
        return {"ok": busy > 0 and cs.bytes == n * jobs, "bytes": cs.bytes, "busy_s": busy,
                "gbps_busy": cs.bytes / busy / 1e9 if busy else None, "gbps_wall": cs.bytes / wall / 1e9,
                "host_enqueue_s": enqueue_s}

    for name, fn in (("pinned", pinned), ("pageable", pageable), ("bidirectional", bidirectional),
                     ("engine_stream", engine_stream)):
        ctx.check(name, fn)
    buf.clear()
    host = host2 = dev = dev2 = None  # noqa: F841 - the matmul probe wants the memory back
    torch.cuda.empty_cache()
    ctx.check("matmul", lambda: _matmul_rates(ctx, n_bf16=8192, n_fp32=4096, reps=10))


def _matmul_rates(ctx: Ctx, n_bf16: int, n_fp32: int, reps: int) -> dict[str, Any]:
    import torch

    res: dict[str, Any] = {"ok": True}
    for label, dtype, n in (("bf16", torch.bfloat16, n_bf16), ("fp32", torch.float32, n_fp32)):
        a = torch.randn(n, n, device=ctx.device, dtype=dtype)
        b = torch.randn(n, n, device=ctx.device, dtype=dtype)
        for _ in range(3):
            a @ b
        _sync(ctx.device)
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        _sync(ctx.device)
        res[f"{label}_tflops"] = 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12
        res[f"{label}_n"] = n
    return res


# == ds_build ===========================================================================================
def phase_ds_build(ctx: Ctx) -> None:
    """Compile DeepSpeed's CPU Adam (and, on the CPU accelerator, its shared-memory comm op) once, so the
    ZeRO-3 points neither pay for it nor time out on it."""

    def build() -> dict[str, Any]:
        t0 = time.perf_counter()
        from deepspeed.ops.op_builder import CPUAdamBuilder

        import_s = time.perf_counter() - t0
        CPUAdamBuilder().load(verbose=False)
        built = ["cpu_adam"]
        if not ctx.cuda:
            from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

            ShareMemCommBuilder().load(verbose=False)
            built.append("deepspeed_shm_comm")
        return {"ok": True, "built": built, "import_s": import_s, "build_s": time.perf_counter() - t0 - import_s}

    ctx.check("cpu_adam", build)


def ds_ops_built(cpu_accelerator: bool) -> bool:
    """Whether the DeepSpeed JIT ops a ZeRO-3 run needs are already in the extensions cache (the
    harness's default cache when TORCH_EXTENSIONS_DIR is unset)."""
    from baselines.zero3 import default_extensions_dir

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or default_extensions_dir()
    names = ["cpu_adam"] + (["deepspeed_shm_comm"] if cpu_accelerator else [])
    return all(glob.glob(os.path.join(root, "**", f"{n}*.so"), recursive=True) for n in names)


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
            first = {n: p.grad.clone() for n, p in eng.named_parameters()}
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


def phase_parity(ctx: Ctx) -> None:
    from megatrain.config import EngineConfig
    from megatrain.engine import Engine

    sh = ctx.shapes()
    steps, accum, clip = 5, 2, 0.5
    batches = make_batches(steps * accum, sh)
    # Tolerances: the design's CPU ones; on a GPU reductions are ordered differently (atomics, other
    # kernels), so gradients get 10x and parameters (where Adam turns noise into +-lr) 10x more room.
    tol = {"grad_rel": 1e-5, "loss_abs": 1e-5, "param_abs": 1e-4} if ctx.cuda else \
          {"grad_rel": 1e-6, "loss_abs": 1e-5, "param_abs": 1e-5}
    dev = str(ctx.device)

    def fp32(family: str, tied: bool, **knobs: Any) -> dict[str, Any]:
        base = tiny_model(family, sh, tied=tied)
        ref = copy.deepcopy(base).to(ctx.device)
        eng = Engine(copy.deepcopy(base), EngineConfig(device=dev, loss_chunk_tokens=13, **knobs))
        rl, rg = _train_reference(ref, batches, steps, accum, clip, ctx.device)
        el, eg, _ = _train_engine(eng, batches, steps, accum, clip)
        res = {"grad_rel": _grad_rel(rg, eg), "loss_abs": max(abs(a - b) for a, b in zip(rl, el)),
               "param_abs": _param_abs(ref, eng), "tolerance": tol, "steps": steps, "accum": accum}
        res["ok"] = all(res[k] <= tol[k] for k in tol) and all(math.isfinite(x) for x in el)
        return res

    ctx.check("fp32_llama", lambda: fp32("llama", False))
    ctx.check("fp32_qwen2_tied", lambda: fp32("qwen2", True))

    def bf16() -> dict[str, Any]:
        base = tiny_model("llama", sh)
        ref32 = copy.deepcopy(base).to(ctx.device)
        refamp = copy.deepcopy(base).to(ctx.device)
        eng = Engine(copy.deepcopy(base), EngineConfig(device=dev, compute_dtype="bfloat16", trace=True,
                                                      offload_activations=False))
        rl, _ = _train_reference(ref32, batches, steps, accum, clip, ctx.device)
        al, _ = _train_reference(refamp, batches, steps, accum, clip, ctx.device, autocast=True)
        el, _, stats = _train_engine(eng, batches, steps, accum, clip)
        loads = sum(1 for r in eng.trace if r.stream == "h2d" and r.kind == "load")  # last step's
        per_layer = eng.store.layers[0].numel
        bytes_per_param = stats[-1]["h2d_bytes"] / (loads * per_layer) if loads else None
        diff = max(abs(a - b) for a, b in zip(rl, el))
        res = {"loss_abs_vs_fp32": diff, "loss_abs_vs_autocast": max(abs(a - b) for a, b in zip(al, el)),
               "autocast_vs_fp32": max(abs(a - b) for a, b in zip(al, rl)),
               "shadow_dtype": str(eng.store.layers[0].shadow.dtype), "streamed_bytes_per_param": bytes_per_param,
               "loads_last_step": loads, "tolerance_vs_fp32": 0.05}
        res["ok"] = (0 < diff <= 0.05 and res["shadow_dtype"] == "torch.bfloat16" and bytes_per_param == 2.0)
        return res

    ctx.check("bf16_llama", bf16)

    def offload() -> dict[str, Any]:
        base = tiny_model("llama", sh)
        res_eng = Engine(copy.deepcopy(base), EngineConfig(device=dev, offload_activations=False))
        off_eng = Engine(copy.deepcopy(base), EngineConfig(device=dev, offload_activations=True))
        rl, rg, rs = _train_engine(res_eng, batches[:4], 2, 2, None)
        ol, og, os_ = _train_engine(off_eng, batches[:4], 2, 2, None)
        diff = max(abs(a - b) for a, b in zip(rl, ol))
        grad = _grad_rel(rg, og)
        limit = 1e-5 if ctx.cuda else 0.0  # on the CPU the two are bit-identical
        return {"ok": diff <= limit and grad <= max(limit, 1e-12) and
                os_[-1]["peak_activation_bytes"] < rs[-1]["peak_activation_bytes"],
                "loss_abs": diff, "grad_rel": grad, "peak_activation_bytes": [rs[-1]["peak_activation_bytes"],
                                                                            os_[-1]["peak_activation_bytes"]]}

    ctx.check("offload_activations", offload)

    def overlap() -> dict[str, Any]:
        # The host optimizer a layer at a time behind the next forward: the same kernels in the same order
        # on the device, so bit-identical to the whole step here too.
        base = tiny_model("llama", sh)
        whole = Engine(copy.deepcopy(base), EngineConfig(device=dev))
        over = Engine(copy.deepcopy(base), EngineConfig(device=dev, optimizer_overlap=True))
        wl, _, _ = _train_engine(whole, batches, steps, accum, clip)
        ol, _, _ = _train_engine(over, batches, steps, accum, clip)
        sw, so = whole.state_dict(), over.state_dict()
        worst = max((sw[k] - so[k]).abs().max().item() for k in sw)
        return {"ok": wl == ol and worst == 0.0 and over._layered is not None, "losses_equal": wl == ol,
                "param_abs": worst}

    ctx.check("optimizer_overlap", overlap)
    for k in (1, 3):
        ctx.check(f"num_buffers_{k}", lambda k=k: fp32("llama", False, num_buffers=k))


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

    from megatrain.config import EngineConfig
    from megatrain.engine import Engine
    from megatrain.engine.stream import DONE, Streams

    sh = ctx.shapes()
    base = tiny_model("llama", sh, seed=3)
    batches = make_batches(2, sh, seed=4)
    dev = str(ctx.device)
    ms = 5.0 if ctx.cuda else 2.0

    def run(knobs: dict | None = None, setup: Callable[[Any], None] | None = None,
            nan_buffers: bool = False) -> dict[str, Any]:
        eng = Engine(copy.deepcopy(base), EngineConfig(device=dev, **(knobs or {})))
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
            from megatrain.engine.activations import ActivationStore

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
        eng = Engine(copy.deepcopy(base), EngineConfig(device=dev, **knobs))
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
        eng = Engine(copy.deepcopy(base), EngineConfig(device=dev, trace=True))
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
def bench_points(dry: bool) -> list[tuple[str, Any]]:
    """(group, point) in the order they run: the megatrain/ZeRO-3 pairs first, the context sweep after."""
    from experiments.spec import Point

    if dry:
        common = {"precision": "fp32", "warmup": 0, "steps": 1}
        return [("pair", Point("megatrain", "tiny", 64, micro_batch=2, **common)),
                ("pair", Point("zero3", "tiny", 64, micro_batch=2, **common)),
                ("context", Point("megatrain", "tiny", 128, micro_batch=1, **common))]
    common = {"precision": "bf16", "warmup": 1, "steps": 2}
    out = []
    for model in ("qwen2.5-1.5b", "qwen2.5-3b"):
        for backend in ("megatrain", "zero3"):
            out.append(("pair", Point(backend, model, 4096, micro_batch=4, **common)))
    for seq, backend in ((32768, "megatrain"), (8192, "megatrain"), (32768, "zero3"), (16384, "megatrain")):
        out.append(("context", Point(backend, "qwen2.5-1.5b", seq, micro_batch=1, **common)))
    return out


POINT_CAP_S = {"megatrain": 150.0, "zero3": 210.0, "torch": 150.0}
POINT_MIN_S = 40.0  # not worth starting with less: building a multi-GB model alone takes ~15 s
DRY_POINT_CAP_S = 120.0
DRY_POINT_MIN_S = 8.0


def phase_bench(ctx: Ctx) -> None:
    from experiments import results as R
    from experiments.runner import point_columns, run_sweep
    from experiments.spec import Sweep
    from megatrain.metrics.provenance import provenance, utc_now

    csv = ctx.out / "results.csv"
    cap = DRY_POINT_CAP_S if ctx.dry else None
    least = DRY_POINT_MIN_S if ctx.dry else POINT_MIN_S
    zero3 = ctx.zero3
    points = bench_points(ctx.dry)
    if zero3 == "build":
        # The compile takes the CPU cores the engine's optimizer and ZeRO-3's CPU Adam run on: wait a
        # little for it, then time the megatrain points first and the ZeRO-3 ones once it is done.
        zero3 = _await_ds_build(ctx, 30.0)
        if zero3 == "building":
            points = sorted(points, key=lambda gp: gp[1].backend == "zero3")
    overlapped = []
    for group, pt in points:
        left = ctx.deadline - time.time() - 2.0
        if pt.backend == "zero3" and zero3 == "building":
            _log("bench: waiting for the DeepSpeed build")
            zero3 = _await_ds_build(ctx, left - 2 * least)
            zero3 = "on" if zero3 == "building" else zero3  # out of patience: the point finishes the build
            left = ctx.deadline - time.time() - 2.0
        elif zero3 == "building":
            overlapped.append(pt.label)
            ctx.info(timed_while_deepspeed_compiled=overlapped)
        reason = None
        if pt.backend == "zero3" and zero3 != "on":
            reason = zero3.partition(":")[2] or "ZeRO-3 not run"
        elif left < least:
            reason = f"out of the check's time budget ({left:.0f} s left, a point needs >= {least:.0f} s)"
        if reason is not None:
            row = {**point_columns(pt, SWEEP_NAME), **provenance(), "status": "skipped", "reason": reason,
                   "timestamp": utc_now()}
            R.append_row(csv, row)
            ctx.check(f"{group}:{pt.label}", lambda r=reason: {"ok": True, "status": "skipped", "reason": r})
            continue
        pt = dataclasses.replace(pt, timeout_s=float(min(cap or POINT_CAP_S[pt.backend], left)))

        def one(pt: Any = pt) -> dict[str, Any]:
            sweep = Sweep(SWEEP_NAME, "experiments/gpu_check.py", "the GPU check's bench phase", [pt])
            summary = run_sweep(sweep, out_dir=ctx.out, force=True, progress=False, log=_log)
            status = summary.statuses.get(pt.point_id, "failed")
            row = R.read_rows(csv).set_index("point_id").loc[pt.point_id].to_dict()
            return {"ok": status == "ok", "status": status, "reason": row.get("reason"),
                    "point_id": pt.point_id, "step_time_s": row.get("step_time_s")}

        ctx.check(f"{group}:{pt.label}", one)


def _await_ds_build(ctx: Ctx, max_wait_s: float) -> str:
    """The background DeepSpeed build's outcome: 'on', 'off:<why>', or 'building' after `max_wait_s`."""
    limit = time.time() + max(0.0, max_wait_s)
    while True:
        rec = _read_json(ctx.out / "phases" / f"{DS_BUILD.name}.json") or {}
        if rec.get("status") in FINAL:
            break
        if time.time() > limit:
            return "building"
        time.sleep(1.0)
    if rec["status"] == "ok":
        return "on"
    return f"off:DeepSpeed's CPU Adam did not build ({rec['status']}: {_first_error(rec)})"


PHASE_FNS: dict[str, Callable[[Ctx], None]] = {
    "env": phase_env, "bandwidth": phase_bandwidth, "ds_build": phase_ds_build, "parity": phase_parity,
    "sync": phase_sync, "stress": phase_stress, "bench": phase_bench,
}
FINAL = ("ok", "failed", "timeout", "skipped")


def run_phases(names: list[str], out: Path, dry: bool, deadline: float, zero3: str, inject: dict[str, str],
               budgets: dict[str, float] | None = None) -> int:
    """Child side: run these phases in order in this process (imports are paid once).

    Each phase records its own deadline; the parent kills this process when one is passed and starts
    a fresh one for the phases after it. After a phase that raised on a GPU this process exits too: a
    CUDA error can poison the context for everything after it.
    """
    import torch

    if set(names) - {"bench", "ds_build"}:
        # Paid once here, outside any phase's budget (transformers alone takes seconds to import).
        with contextlib.suppress(ImportError):
            import megatrain.engine  # noqa: F401
    for name in names:
        spec = SPECS[name]
        own = (budgets or {}).get(name, spec.dry_budget_s if dry else spec.budget_s)
        budget = min(own, deadline - SUMMARY_RESERVE_S - time.time())
        if budget < 3:
            _atomic_write(out / "phases" / f"{name}.json", json.dumps(
                {"phase": name, "status": "skipped", "reason": "no time left in the check's budget", "checks": {}}))
            continue
        _log(f"{name}: started (budget {budget:.0f} s)")
        ctx = Ctx(name, out, dry, time.time() + budget, zero3)
        try:
            if inject.get(name) == "fail":
                raise RuntimeError(f"injected failure in phase {name}")
            if inject.get(name) == "hang":
                time.sleep(3600)
            PHASE_FNS[name](ctx)
            ctx.finish()
        except Exception as exc:  # noqa: BLE001 - recorded; the parent carries on with the next phase
            traceback.print_exc()
            ctx.data.update(status="failed", reason=f"{type(exc).__name__}: {exc}"[:500])
            ctx._write()
            if ctx.cuda:
                return 3
        _log(f"{name}: {ctx.data['status']} ({time.time() - ctx.started:.1f} s)")
        if ctx.cuda:
            gc.collect()  # engines hold reference cycles; their device buffers go back before the next phase
            torch.cuda.empty_cache()
    return 0


# == orchestration ==========================================================================================
SPECS = {p.name: p for p in [*PHASES, DS_BUILD]}
GRACE_S = 3.0


class Orchestrator:
    """Runs the phases in a supervised child process (DeepSpeed's build in a second one beside it),
    enforces every phase's deadline, and publishes the summary after each phase."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dry = args.dry_run
        self.out = Path(args.out)
        self.bundle = Path(args.bundle) if args.bundle else None
        budget = args.budget_s or (DRY_TOTAL_BUDGET_S if self.dry else TOTAL_BUDGET_S)
        self.deadline = _T0 + budget
        self.inject = [i for i in args.inject]
        self.only = set(args.only.split(",")) if args.only else None
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", GPU_CHECK_T0=str(_T0))
        self.env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + ([self.env["PYTHONPATH"]]
                                                                     if self.env.get("PYTHONPATH") else []))
        # Deterministic cuBLAS, so the stress phase can ask for equal results, not close ones.
        self.env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        if self.dry:
            self.env["CUDA_VISIBLE_DEVICES"] = ""  # tiny shapes on the CPU, even on a GPU machine

    def _cmd(self, phases: list[str], zero3: str) -> list[str]:
        cmd = [sys.executable, "-m", "experiments.gpu_check", "--phase", ",".join(phases), "--out", str(self.out),
               "--deadline", str(self.deadline), "--zero3", zero3]
        if self.dry:
            cmd.append("--dry-run")
        for item in self.inject:
            cmd += ["--inject", item]
        for item in self.args.phase_budget:
            cmd += ["--phase-budget", item]
        return cmd

    def _spawn(self, phases: list[str], zero3: str) -> subprocess.Popen:
        return subprocess.Popen(self._cmd(phases, zero3), cwd=str(REPO_ROOT), env=self.env, start_new_session=True)

    def _record(self, name: str) -> dict[str, Any] | None:
        return _read_json(self.out / "phases" / f"{name}.json")

    def _finalize(self, name: str, status: str, reason: str) -> None:
        rec = self._record(name) or {"phase": name, "checks": {}}
        rec.update(status=status, reason=reason)
        if rec.get("started"):
            rec["wall_s"] = round(time.time() - rec["started"], 1)
        _atomic_write(self.out / "phases" / f"{name}.json", json.dumps(rec, indent=1))
        _log(f"{name}: {status}: {reason}")

    def run(self) -> int:
        self.out.mkdir(parents=True, exist_ok=True)
        for f in (self.out / "phases").glob("*.json"):
            f.unlink()  # a record from an earlier run must not pass for this one's
        todo = [p.name for p in PHASES if self.only is None or p.name in self.only]
        zero3 = self.zero3_plan() if "bench" in todo else "off:bench phase not selected"
        plans = []
        if zero3 == "build":
            plans.append([DS_BUILD.name])  # compiles beside the correctness phases
        if self.dry and "bench" in todo and len(todo) > 1:
            # Timings mean nothing on the CPU: run the bench beside the rest instead of after it.
            plans += [[n for n in todo if n != "bench"], ["bench"]]
        elif todo:
            plans.append(todo)
        groups = [{"todo": names, "proc": self._spawn(names, zero3)} for names in plans]
        published: set[str] = set()
        while groups:
            time.sleep(0.2)
            for g in list(groups):
                if not self._supervise(g, zero3):
                    groups.remove(g)
            if time.time() > self.deadline + GRACE_S:
                for g in groups:  # a phase that never got to set its own deadline
                    _kill_group(g["proc"])
                    for n in g["todo"]:
                        if (self._record(n) or {}).get("status") not in FINAL:
                            self._finalize(n, "timeout", "the whole check ran out of its time budget")
                groups = []
            done = {n for n in SPECS if (self._record(n) or {}).get("status") in FINAL}
            if done - published:
                published |= done
                self.publish()
        self.publish(final=True)
        statuses = {n: (self._record(n) or {}).get("status") for n in SPECS}
        bad = {n: s for n, s in statuses.items() if s not in (None, "ok", "skipped")}
        return 1 if bad else 0

    def _supervise(self, g: dict[str, Any], zero3: str) -> bool:
        """Kill a child whose current phase is past its deadline, or notice that it died; go on with a fresh
        one for the phases after the broken one. False once the group has nothing left to run."""
        proc, todo = g["proc"], g["todo"]
        recs = {n: self._record(n) or {} for n in todo}
        current = next((n for n in todo if recs[n].get("status") == "running"), None)
        exited = proc.poll() is not None
        if current is not None and not exited and time.time() > recs[current]["deadline"] + GRACE_S:
            _kill_group(proc)
            self._finalize(current, "timeout", f"exceeded its {recs[current]['budget_s']:.0f} s budget; "
                                               "checks finished before that are kept")
        elif not exited:
            return True
        elif current is not None:
            self._finalize(current, "failed", f"its process died (exit code {proc.returncode})")
        else:
            first = next((n for n in todo if recs[n].get("status") not in FINAL), None)
            if first is not None and proc.returncode != 0:
                self._finalize(first, "failed", f"its process exited (code {proc.returncode}) before it started")
        rest = [n for n in todo if (self._record(n) or {}).get("status") not in FINAL]
        if not rest:
            return False
        g.update(todo=rest, proc=self._spawn(rest, zero3))
        return True

    def zero3_plan(self) -> str:
        """'build' (compile DeepSpeed's op beside the other phases), 'on', or 'off:<reason>'."""
        mode = self.args.zero3
        if mode == "off":
            return "off:ZeRO-3 disabled (--zero3 off)"
        if _missing("deepspeed"):
            return "off:the deepspeed package is not installed (carry its wheel: scripts/fetch_wheels.sh)"
        if self.dry:
            if ds_ops_built(cpu_accelerator=True):
                return "on"
            if mode == "auto":
                return ("off:DeepSpeed's C++ ops are not built in TORCH_EXTENSIONS_DIR yet (a one-time ~85 s JIT "
                        "build, too long for the dry run's budget); --zero3 on includes it")
        return "build"

    # -- outputs ---------------------------------------------------------------------------------------
    def publish(self, final: bool = False) -> None:
        try:
            phases = {n: r for n in SPECS if (r := self._record(n)) is not None}
            summary = build_summary(self.out, phases, self.dry)
            _atomic_write(self.out / "summary.json", json.dumps(summary, indent=1, default=_json_default))
            md = render_markdown(summary)
            _atomic_write(self.out / "summary.md", md)
            if self.bundle is not None:
                self.copy_bundle(summary)
        except Exception:  # noqa: BLE001 - a summary bug must not cost the measurements
            traceback.print_exc()
            md = "(summary failed; see the traceback above and phases/*.json)"
        if final:
            print("\n" + md, flush=True)

    def copy_bundle(self, summary: dict[str, Any]) -> None:
        b = self.bundle
        b.mkdir(parents=True, exist_ok=True)
        for name in ("summary.md", "summary.json", "results.csv"):
            if (self.out / name).exists():
                shutil.copyfile(self.out / name, b / name)
        tl = summary.get("timeline", {}).get("trace_file")
        if tl and (self.out / tl).exists():
            shutil.copyfile(self.out / tl, b / "timeline.json")
        tmp = b / ".gpu_check.tar.gz.tmp"
        with tarfile.open(tmp, "w:gz") as tar:
            tar.add(self.out, arcname="gpu_check")
        os.replace(tmp, b / "gpu_check.tar.gz")


def _first_error(rec: dict[str, Any]) -> str:
    for c in rec.get("checks", {}).values():
        if c.get("error"):
            return c["error"][:200]
    return rec.get("reason", "")


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, 15)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        proc.wait()


# == summary ================================================================================================
def _interval_union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _overlap(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    total, j = 0.0, 0
    for a, b in xs:
        while j < len(ys) and ys[j][1] <= a:
            j += 1
        k = j
        while k < len(ys) and ys[k][0] < b:
            total += max(0.0, min(b, ys[k][1]) - max(a, ys[k][0]))
            k += 1
    return total


def trace_metrics(records: list[list]) -> dict[str, float]:
    """Overlap figures of one step's timeline: how much of the link's time compute hid, and how long
    compute sat idle inside the step."""
    by: dict[str, list[tuple[float, float]]] = {}
    for stream, _kind, _layer, t0, t1 in records:
        by.setdefault(stream, []).append((t0, t1))
    u = {s: _interval_union(v) for s, v in by.items()}
    span = max(r[4] for r in records) - min(r[3] for r in records)
    comp = u.get("compute", [])
    busy = {s: sum(b - a for a, b in v) for s, v in u.items()}
    out = {"span_s": span, **{f"{s}_busy_s": v for s, v in busy.items()}}
    if comp and span > 0:
        out["compute_busy_frac"] = busy["compute"] / span
        for s in ("h2d", "d2h"):
            if u.get(s):
                out[f"{s}_hidden_frac"] = _overlap(u[s], comp) / busy[s]
    return out


def build_summary(out: Path, phases: dict[str, dict[str, Any]], dry: bool) -> dict[str, Any]:
    s: dict[str, Any] = {"dry_run": dry, "out": str(out), "elapsed_s": round(time.time() - _T0, 1),
                         "phases": {n: {k: v for k, v in r.items() if k != "checks"} | {
                             "checks": {c: {"ok": v.get("ok"), **({"error": v["error"]} if v.get("error") else {})}
                                        for c, v in r.get("checks", {}).items()}}
                             for n, r in phases.items()}}
    figs: dict[str, Any] = {}
    checks = {n: r.get("checks", {}) for n, r in phases.items()}
    par = checks.get("parity", {})
    if par:
        figs["parity"] = {k: {m: v.get(m) for m in ("grad_rel", "loss_abs", "param_abs", "loss_abs_vs_fp32",
                                                     "loss_abs_vs_autocast", "streamed_bytes_per_param")
                              if v.get(m) is not None} | {"ok": v.get("ok")} for k, v in par.items()}
    sy = checks.get("sync", {})
    if sy:
        figs["sync"] = {k: {m: v.get(m) for m in ("syncs_in_loop", "syncs_outside_loop", "syncs_caught")
                            if m in v} | {"ok": v.get("ok")} for k, v in sy.items()}
    bw = checks.get("bandwidth", {})
    peak_h2d = bw.get("pinned", {}).get("h2d_peak_gbps")
    if bw:
        figs["bandwidth"] = {"h2d_peak_gbps": peak_h2d, "d2h_peak_gbps": bw.get("pinned", {}).get("d2h_peak_gbps"),
                             "pageable_h2d_gbps": bw.get("pageable", {}).get("h2d_gbps"),
                             "bidirectional_gbps": bw.get("bidirectional", {}).get("aggregate_gbps"),
                             "engine_stream_gbps": bw.get("engine_stream", {}).get("gbps_busy"),
                             "memcpy_gbps": bw.get("memcpy", {}).get("memcpy_gbps"),
                             "bf16_tflops": bw.get("matmul", {}).get("bf16_tflops"),
                             "fp32_tflops": bw.get("matmul", {}).get("fp32_tflops")}
    rows = _read_rows(out / "results.csv")
    points = []
    for r in rows:
        p = {k: r.get(k) for k in ("label", "status", "backend", "model", "seq_len", "micro_batch", "precision",
                                   "tokens_per_step", "step_time_s", "tokens_per_s", "model_tflops", "mfu",
                                   "copy_wait_s", "forward_s", "backward_s", "optimizer_s", "h2d_gbps",
                                   "h2d_gbps_busy", "link_util", "peak_device_bytes", "host_bytes_per_param",
                                   "reason", "trace_file")}
        if p["copy_wait_s"] is not None and p["step_time_s"]:
            p["copy_wait_frac"] = p["copy_wait_s"] / p["step_time_s"]
        if peak_h2d and p["h2d_gbps_busy"]:
            p["h2d_busy_vs_probe"] = p["h2d_gbps_busy"] / peak_h2d
        if p.get("trace_file") and (out / p["trace_file"]).exists():
            tr = _read_json(out / p["trace_file"]) or {}
            if tr.get("records"):
                p["trace"] = trace_metrics(tr["records"])
        points.append(p)
    s["points"] = points
    ratios = []
    ok = [p for p in points if p["status"] == "ok"]
    for m in ok:
        if m["backend"] != "megatrain":
            continue
        for z in ok:
            if z["backend"] == "zero3" and all(z[k] == m[k] for k in ("model", "seq_len", "micro_batch", "precision")):
                ratios.append({"model": m["model"], "seq_len": m["seq_len"], "micro_batch": m["micro_batch"],
                               "megatrain_step_s": m["step_time_s"], "zero3_step_s": z["step_time_s"],
                               "speedup": z["step_time_s"] / m["step_time_s"],
                               "megatrain_tflops": m["model_tflops"], "zero3_tflops": z["model_tflops"]})
    figs["megatrain_vs_zero3"] = ratios
    mt = [p for p in ok if p["backend"] == "megatrain" and p.get("trace_file")]
    if mt:
        big = max(mt, key=lambda p: (_params_of(p), p.get("tokens_per_step") or 0))
        s["timeline"] = {"label": big["label"], "trace_file": big["trace_file"], **(big.get("trace") or {})}
    s["figures"] = figs
    return s


def _params_of(p: dict[str, Any]) -> float:
    try:
        from megatrain.models.presets import get_preset

        return float(get_preset(p["model"]).param_count())
    except Exception:  # noqa: BLE001
        return 0.0


def _read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    from experiments.results import read_rows

    df = read_rows(path)
    df = df.astype(object).where(df.notna(), None)
    return df.to_dict("records")


def _f(v: Any, fmt: str = ".3g") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (int, float)):
        return format(v, fmt)
    return str(v)


def render_markdown(s: dict[str, Any]) -> str:
    lines = [f"# MegaTrain GPU check{' (dry run: CPU, tiny shapes)' if s['dry_run'] else ''}", "",
             f"elapsed {s['elapsed_s']:.0f} s; full results in `{s['out']}`", "",
             "| phase | status | wall s | budget s | failed checks |", "| --- | --- | --- | --- | --- |"]
    for name, r in s["phases"].items():
        failed = [c + (f" ({v['error'][:80]})" if v.get("error") else "")
                  for c, v in r.get("checks", {}).items() if not v.get("ok")]
        why = "; ".join(failed) or r.get("reason", "") if r.get("status") != "ok" else ""
        lines.append(f"| {name} | {r.get('status')} | {_f(r.get('wall_s'))} | {_f(r.get('budget_s'))} | {why} |")
    f = s.get("figures", {})
    if f.get("parity"):
        lines += ["", "## Parity (engine vs plain PyTorch on the same device)", "",
                  "| case | ok | grad rel | loss abs | param abs | bf16 vs fp32 loss | bf16 vs autocast | B/param streamed |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for k, v in f["parity"].items():
            lines.append(f"| {k} | {_f(v.get('ok'))} | {_f(v.get('grad_rel'))} | {_f(v.get('loss_abs'))} | "
                         f"{_f(v.get('param_abs'))} | {_f(v.get('loss_abs_vs_fp32'))} | "
                         f"{_f(v.get('loss_abs_vs_autocast'))} | {_f(v.get('streamed_bytes_per_param'))} |")
    if f.get("sync"):
        lines += ["", "## Synchronizations", "", "| case | ok | in the per-layer loop | elsewhere in the step | planted, caught |",
                  "| --- | --- | --- | --- | --- |"]
        for k, v in f["sync"].items():
            lines.append(f"| {k} | {_f(v.get('ok'))} | {_f(v.get('syncs_in_loop'))} | "
                         f"{_f(v.get('syncs_outside_loop'))} | {_f(v.get('syncs_caught'))} |")
    if f.get("bandwidth"):
        b = f["bandwidth"]
        lines += ["", "## Link and compute ceilings", "",
                  f"pinned H2D {_f(b['h2d_peak_gbps'])} GB/s, D2H {_f(b['d2h_peak_gbps'])} GB/s, both at once "
                  f"{_f(b['bidirectional_gbps'])} GB/s; pageable H2D {_f(b['pageable_h2d_gbps'])} GB/s; engine copy "
                  f"stream {_f(b['engine_stream_gbps'])} GB/s; memcpy {_f(b['memcpy_gbps'])} GB/s; matmul bf16 "
                  f"{_f(b['bf16_tflops'])} / fp32 {_f(b['fp32_tflops'])} TFLOPS"]
    if s.get("points"):
        lines += ["", "## megatrain vs ZeRO-3 offload, context sweep (harness rows)", "",
                  "| point | status | step s | tok/s | TFLOPS | MFU | copy-wait frac | h2d GB/s step / busy | "
                  "busy vs probe | h2d hidden | peak dev GiB | host B/param |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for p in s["points"]:
            tr = p.get("trace") or {}
            dev_gib = p["peak_device_bytes"] / 2**30 if p.get("peak_device_bytes") else None
            status = p["status"] if p["status"] == "ok" else f"{p['status']}: {(p.get('reason') or '')[:70]}"
            lines.append(f"| {p['label']} | {status} | {_f(p['step_time_s'])} | {_f(p['tokens_per_s'], '.0f')} | "
                         f"{_f(p['model_tflops'])} | {_f(p['mfu'], '.2f')} | {_f(p.get('copy_wait_frac'), '.2f')} | "
                         f"{_f(p['h2d_gbps'])} / {_f(p['h2d_gbps_busy'])} | {_f(p.get('h2d_busy_vs_probe'), '.2f')} | "
                         f"{_f(tr.get('h2d_hidden_frac'), '.2f')} | {_f(dev_gib)} | {_f(p['host_bytes_per_param'])} |")
    if f.get("megatrain_vs_zero3"):
        lines += ["", "| model | seq x batch | megatrain s | ZeRO-3 s | speed-up | TFLOPS megatrain / ZeRO-3 |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for r in f["megatrain_vs_zero3"]:
            lines.append(f"| {r['model']} | {r['seq_len']} x {r['micro_batch']} | {_f(r['megatrain_step_s'])} | "
                         f"{_f(r['zero3_step_s'])} | {_f(r['speedup'])}x | {_f(r['megatrain_tflops'])} / "
                         f"{_f(r['zero3_tflops'])} |")
    if s.get("timeline"):
        t = s["timeline"]
        lines += ["", f"timeline ({t['label']}, `{t['trace_file']}`): step span {_f(t.get('span_s'))} s, compute busy "
                      f"{_f(t.get('compute_busy_frac'), '.2f')}, h2d hidden behind compute {_f(t.get('h2d_hidden_frac'), '.2f')}, "
                      f"d2h hidden {_f(t.get('d2h_hidden_frac'), '.2f')}"]
    return "\n".join(lines) + "\n"


# == entry ====================================================================================================
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.gpu_check", description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="the same script on the CPU with tiny shapes")
    ap.add_argument("--out", default=None, help="results folder (default: results/gpu/<UTC time>, or a temp "
                                                "folder when $OUT is set)")
    ap.add_argument("--bundle", default=os.environ.get("OUT"),
                    help="where to copy the <= 6 files to bring back (default: $OUT)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help=f"whole-check budget from the wrapper's start (default {TOTAL_BUDGET_S:.0f}, "
                         f"dry run {DRY_TOTAL_BUDGET_S:.0f})")
    ap.add_argument("--only", default=None, help=f"comma-separated phases to run ({', '.join(p.name for p in PHASES)})")
    ap.add_argument("--zero3", default="auto", help="auto | on | off: include the DeepSpeed ZeRO-3 points")
    ap.add_argument("--inject", action="append", default=[], metavar="PHASE=fail|hang",
                    help=argparse.SUPPRESS)  # for the tests: a phase that breaks
    ap.add_argument("--phase-budget", action="append", default=[], metavar="PHASE=SECONDS",
                    help=argparse.SUPPRESS)  # for the tests: a shorter budget
    ap.add_argument("--phase", default=None, help=argparse.SUPPRESS)  # child side: phases to run, in order
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.out is None:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        if os.environ.get("OUT"):
            args.out = f"/tmp/megatrain-gpu-check-{stamp}"  # fresh: a warm machine may hold an earlier run
        else:
            args.out = str(REPO_ROOT / "results" / ("gpu-dry" if args.dry_run else "gpu") / stamp)
    if args.phase:
        names = args.phase.split(",")
        unknown = [n for n in names if n not in SPECS]
        if unknown:
            ap.error(f"unknown phase(s) {unknown}; known: {', '.join(SPECS)}")
        inject = dict(item.partition("=")[::2] for item in args.inject)
        budgets = {k: float(v) for k, v in (item.partition("=")[::2] for item in args.phase_budget)}
        deadline = args.deadline or time.time() + (DRY_TOTAL_BUDGET_S if args.dry_run else TOTAL_BUDGET_S)
        return run_phases(names, Path(args.out), args.dry_run, deadline, args.zero3, inject, budgets)
    return Orchestrator(args).run()


if __name__ == "__main__":
    sys.exit(main())
