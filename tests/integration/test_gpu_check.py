"""The GPU check (experiments/gpu_check/): its dry run on the CPU, its failure isolation, its summary
arithmetic, the wheel list it carries; and, where CUDA exists, its checks of the CUDA path itself."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch
from kit import run_python, worker_env

from experiments import gpu_check as gc

ROOT = Path(__file__).resolve().parents[2]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _env(**extra: str) -> dict[str, str]:
    return worker_env(drop=("GPU_CHECK_T0",), PYTHON=sys.executable, **extra)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """One full dry run through the shell wrapper, as CI and a developer would start it."""
    base = tmp_path_factory.mktemp("gpu_check")
    out, bundle = base / "out", base / "bundle"
    t0 = time.time()
    proc = subprocess.run(["bash", "experiments/gpu_check.sh", "--dry-run", "--out", str(out)], cwd=ROOT,
                          env=_env(OUT=str(bundle)), capture_output=True, text=True, timeout=900)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    return {"proc": proc, "out": out, "bundle": bundle, "summary": summary, "wall_s": time.time() - t0}


def _phase(dry_run, name):
    return json.loads((dry_run["out"] / "phases" / f"{name}.json").read_text())


@pytest.mark.slow
def test_dry_run_passes_every_phase(dry_run):
    proc = dry_run["proc"]
    phases = dry_run["summary"].get("phases", {})
    assert proc.returncode == 0, (proc.stdout[-4000:], proc.stderr[-2000:])
    assert set(phases) == {p.name for p in gc.PHASES}
    # dp2 needs two GPUs, and the dry run hides every device: it skips and says so (tests/unit/test_gpu_check_dp2.py
    # runs its check on gloo ranks)
    assert phases["dp2"]["status"] == "skipped" and phases["dp2"]["reason"] == "needs 2 GPUs (found 0)", phases["dp2"]
    assert all(p["status"] == "ok" for n, p in phases.items() if n != "dp2"), phases
    assert dry_run["summary"]["elapsed_s"] <= gc.common.TOTAL_BUDGET_S  # every phase within the 280 s
    assert phases["bench"]["budget_s"] >= gc.common.BENCH_MIN_S
    for name in phases:  # no process of the check loaded what the GPU image lacks
        assert _phase(dry_run, name)["modules_not_on_the_image"] == [], name


@pytest.mark.slow
def test_dry_run_features_speculation_nan_and_residency(dry_run):
    checks = _phase(dry_run, "features")["checks"]
    assert checks["speculation_clip_scales"]["speculative_rollbacks"] > 0
    assert checks["speculation_clip_idle"]["speculative_rollbacks"] == 0
    for name in ("speculation_clip_scales", "speculation_clip_idle"):
        assert checks[name]["losses_identical"] and not checks[name]["weights_differing"], checks[name]
    assert checks["nan_loss_skipped"]["stepped"][:2] == [True, False]
    assert checks["residency_stream_vs_auto_identical"]["ok"]
    assert checks["device_batches_no_sync"]["status"] == "skipped"  # CUDA only


@pytest.mark.slow
def test_dry_run_prints_the_summary_table_last(dry_run):
    text = dry_run["proc"].stdout.rstrip()
    md = (dry_run["out"] / "summary.md").read_text().rstrip()
    assert text.endswith(md)
    assert "| parity | ok |" in md and "| bench | ok |" in md


@pytest.mark.slow
def test_dry_run_parity_numbers(dry_run):
    checks = _phase(dry_run, "parity")["checks"]
    for case in ("fp32_llama", "fp32_qwen2_tied", "num_buffers_1", "num_buffers_3"):
        c = checks[case]
        assert c["grad_rel"] <= 1e-6 and c["loss_abs"] <= 1e-5 and c["param_abs"] <= 1e-5, (case, c)
    bf16 = checks["bf16_llama"]
    assert 0 < bf16["loss_abs_vs_fp32"] <= 0.05 and bf16["streamed_bytes_per_param"] == 2.0
    assert checks["offload_activations"]["loss_abs"] == 0


@pytest.mark.slow
def test_dry_run_finds_no_sync_in_the_layer_loop_and_catches_a_planted_one(dry_run):
    checks = _phase(dry_run, "sync")["checks"]
    loops = {k: v for k, v in checks.items() if k.startswith("loop_")}
    assert len(loops) >= 4
    assert all(v["syncs_in_loop"] == 0 for v in loops.values()), {k: v["in_loop"] for k, v in loops.items()}
    assert checks["planted_sync_is_caught"]["syncs_caught"] >= 3  # once per layer at least


@pytest.mark.slow
def test_dry_run_stress_catches_a_missing_wait(dry_run):
    checks = _phase(dry_run, "stress")["checks"]
    assert checks["missing_wait_is_caught"]["caught"] is True
    assert all(checks[k]["ok"] for k in ("slow_h2d", "slow_d2h", "slow_compute_offloaded_activations"))


@pytest.mark.slow
def test_dry_run_writes_the_bench_rows_with_predictions_and_a_timeline(dry_run):
    out = dry_run["out"]
    rows = {r["point"]: r for r in gc.bench.read_rows(out / "results.csv")}
    assert set(rows) == {p.name for p in gc.bench_points(dry=True)}
    assert all(r["status"] == "ok" for r in rows.values()), rows
    for name in ("stream", "auto", "torch"):
        r = rows[name]
        assert r["step_time_s"] > 0 and r["steps"] >= 2 and r["pred_step_time_s"] > 0, r
        assert r["err_step_pct"] == pytest.approx(100 * (r["pred_step_time_s"] - r["step_time_s"]) / r["step_time_s"],
                                                  abs=0.06)
    s = rows["stream"]
    assert s["h2d_bytes_per_step"] > 0 and s["d2h_bytes_per_step"] > 0 and s["pred_h2d_gbps"] > 0
    assert 0 <= s["gpu_idle_fraction"] < 1
    trace = json.loads((out / s["trace_file"]).read_text())
    assert {"compute", "h2d", "d2h"} <= {r[0] for r in trace["records"]}
    tl = dry_run["summary"]["timeline"]
    assert 0 < tl["compute_busy_frac"] <= 1 and 0 <= tl["h2d_hidden_frac"] <= 1
    assert set(dry_run["summary"]["figures"]["vs_torch"]) == {"stream", "auto"}


@pytest.mark.slow
def test_dry_run_bundle_is_small_and_whole(dry_run):
    bundle = dry_run["bundle"]
    files = sorted(p.name for p in bundle.iterdir())
    assert len(files) <= 8, files  # the few files worth reading first, each small
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", f) for f in files)
    assert {"summary.md", "summary.json", "results.csv", "timeline.json", "gpu_check.tar.gz", "log.txt"} <= set(files)
    assert all((bundle / f).stat().st_size < 16 << 20 for f in files)
    with tarfile.open(bundle / "gpu_check.tar.gz") as tar:
        names = tar.getnames()
    assert "gpu_check/phases/parity.json" in names and "gpu_check/traces/stream.json" in names
    assert "gpu_check" in (bundle / "log.txt").read_text()


@pytest.mark.slow
def test_a_hanging_phase_and_a_failing_phase_cost_only_themselves(tmp_path):
    """env hangs past its budget (its process is killed), bandwidth raises; stress still runs and every
    result is recorded."""
    out = tmp_path / "out"
    cmd = ["-m", "experiments.gpu_check", "--dry-run", "--out", str(out), "--only",
           "env,bandwidth,stress", "--inject", "env=hang", "--inject", "bandwidth=fail", "--phase-budget", "env=4"]
    proc = run_python(cmd, env=_env(), timeout=600)
    assert proc.returncode == 1, proc.stdout[-3000:]
    status = {n: json.loads((out / "phases" / f"{n}.json").read_text())["status"] for n in ("env", "bandwidth", "stress")}
    assert status == {"env": "timeout", "bandwidth": "failed", "stress": "ok"}, status
    assert "injected failure" in json.loads((out / "phases" / "bandwidth.json").read_text())["reason"]
    md = (out / "summary.md").read_text()
    assert "| env | timeout |" in md and "| stress | ok |" in md


# -- the pieces, without processes ----------------------------------------------------------------------
def test_trace_metrics_overlap_arithmetic():
    recs = [["compute", "fwd", 0, 0.0, 1.0], ["compute", "fwd", 1, 2.0, 3.0],
            ["h2d", "load", 1, 0.5, 2.5], ["d2h", "grad", 0, 3.0, 4.0]]
    m = gc.trace_metrics(recs)
    assert m["span_s"] == 4.0 and m["compute_busy_s"] == 2.0 and m["compute_busy_frac"] == 0.5
    assert m["h2d_hidden_frac"] == pytest.approx(1.0 / 2.0)  # 0.5-1.0 and 2.0-2.5 of a 2 s copy
    assert m["d2h_hidden_frac"] == 0.0


def test_summary_puts_each_point_beside_its_prediction_and_plain_pytorch(tmp_path):
    base = {"status": "ok", "layers": 8, "hidden": 4096, "seq_len": 4096, "steps": 5}
    gc.bench.append_row(tmp_path / "results.csv", {**base, "point": "stream", "backend": "megatrain",
                                                   "step_time_s": 3.0, "pred_step_time_s": 2.4, "err_step_pct": -20.0,
                                                   "h2d_gbps": 20.0, "pred_h2d_gbps": 22.0, "err_h2d_pct": 10.0})
    gc.bench.append_row(tmp_path / "results.csv", {**base, "point": "torch", "backend": "torch", "step_time_s": 1.5})
    s = gc.build_summary(tmp_path, {}, dry=False)
    assert s["figures"]["vs_torch"] == {"stream": pytest.approx(2.0)}
    md = gc.render_markdown(s)
    assert "stream 2.00x" in md and "| stream | ok | 5 | 3 (2.4, -20) |" in md and "20 (22, 10)" in md


def test_wheel_list_pins_this_venv_and_leaves_torch_to_the_device():
    from packaging.requirements import Requirement

    proc = run_python(["scripts/wheel_list.py"], check=True)
    reqs = {r.name: r for r in map(Requirement, proc.stdout.split())}
    import importlib.metadata as md

    # numpy and pandas: transformers and experiments/results.py import them (they were left to the image).
    for name in ("transformers", "accelerate", "deepspeed", "safetensors", "pydantic", "hjson", "numpy", "pandas"):
        assert str(reqs[name].specifier) == f"=={md.version(name)}", name
    # NVML's bindings (the `gpu` extra) are carried although named like torch's CUDA libraries, which are not.
    try:
        want = f"=={md.version('nvidia-ml-py')}"
    except md.PackageNotFoundError:
        want = ">=12"  # not in this venv: the range pyproject.toml declares
    assert str(reqs["nvidia-ml-py"].specifier) == want
    assert not any(n == "torch" or n.startswith(("nvidia-cu", "triton")) for n in reqs)
    assert "wheels" in (ROOT / ".gitignore").read_text()
    bad = run_python(["scripts/wheel_list.py"], env=worker_env(MEGATRAIN_DEVICE_PYTHON="312"))
    assert bad.returncode != 0 and "'312' is not a Python version" in bad.stderr


def test_wheels_for_another_python_stop_the_check_before_it_runs(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "tokenizers-0.1-cp39-abi3-manylinux_2_17_x86_64.whl").write_bytes(b"")
    have = f"{sys.version_info[0]}.{sys.version_info[1]}"
    other = "3.9" if have != "3.9" else "3.10"
    for recorded in (other, None):  # fetch_wheels.sh's record, else a binary wheel's tag
        if recorded is not None:
            (wheels / "python-version").write_text(other + "\n")
        elif (wheels / "python-version").exists():
            (wheels / "python-version").unlink()
        if recorded is None and other != "3.9":
            continue
        proc = subprocess.run(["bash", "experiments/gpu_check.sh", "--out", str(tmp_path / "out")], cwd=ROOT,
                              env=_env(MEGATRAIN_WHEELS=str(wheels)), capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, proc.stdout[-2000:]
        assert f"for Python {other} but" in proc.stdout and f"is Python {have}" in proc.stdout
        assert f"MEGATRAIN_DEVICE_PYTHON={have}" in proc.stdout
        assert "env: started" not in proc.stdout and not (tmp_path / "out").exists()  # nothing ran


def test_every_thread_brings_other_threads_ops_to_the_shared_mode():
    import threading

    from torch.utils._python_dispatch import TorchDispatchMode

    from experiments.gpu_check.every_thread import every_thread

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.by_thread = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = threading.current_thread().name
            self.by_thread[name] = self.by_thread.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    def work():
        torch.ones(4).add_(1).mul(2)

    mode = Count()
    with mode:
        t = threading.Thread(target=work, name="plain")
        t.start()
        t.join()
        assert "plain" not in mode.by_thread  # control: a mode is its own thread's only (the old coverage)
        with every_thread(mode) as seen:
            t = threading.Thread(target=work, name="copy-thread")
            t.start()
            t.join()
    assert mode.by_thread["copy-thread"] >= 3 and seen["copy-thread"] == mode.by_thread["copy-thread"]
    assert threading.Thread.run.__name__ == "run" and "__torch_dispatch__" in Count.__dict__  # restored


# -- CUDA only: the same phases, on the GPU, in this process -------------------------------------------------
def _ctx(tmp_path, phase):
    return gc.Ctx(phase, tmp_path, dry=False, deadline=time.time() + 600)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("phase", ["parity", "features", "sync", "stress", "sanitizer", "bandwidth"])
def test_cuda_phase(tmp_path, phase):
    ctx = _ctx(tmp_path, phase)
    assert ctx.cuda
    gc.PHASE_FNS[phase](ctx)
    failed = {k: v for k, v in ctx.data["checks"].items() if not v.get("ok")}
    assert not failed, failed


@pytest.mark.cuda
@cuda
def test_cuda_stats_are_device_time(tmp_path):
    """On a GPU the host only queues work: copy time and compute's waits must come from CUDA events."""
    from megatrain.config.schema import EngineConfig
    from megatrain.engine import Engine

    sh = gc.SHAPES[("stress", True)]
    eng = Engine(gc.tiny_model("llama", sh), EngineConfig(device="cuda", trace=True))
    gc.slow_copies(eng, "h2d", 10.0, ("load",))
    batch = gc.make_batches(1, sh)[0]
    eng.reset_stats()
    eng.backward(eng(**batch).loss)
    st = eng.collect_stats()
    loads = [r for r in eng.trace if r.stream == "h2d" and r.kind == "load"]
    assert len(loads) >= sh.layers
    assert min(r.t_end - r.t_start for r in loads) >= 0.008  # the 10 ms spin kernel is inside each copy
    assert st["h2d_busy_s"] >= 0.008 * len(loads)
    assert st["copy_wait_s"] > 0.005  # compute waited on the slowed link


def test_cuda_event_accounting_logic_with_a_fake_device(monkeypatch):
    """The engine's CUDA bookkeeping (copy busy time, compute's waits, the device-timed trace) on fake
    events whose timestamps are set by hand: runs everywhere, so a slip there shows before a GPU run."""
    from megatrain.engine.runtime import stream as S

    clock = {"t": 0.0}

    class FakeEvent:
        def __init__(self, enable_timing: bool = False) -> None:
            self.t = None

        def record(self, stream=None) -> None:
            self.t = clock["t"]

        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, end) -> float:
            return (end.t - self.t) * 1e3

    class FakeStream:
        def __init__(self, device=None) -> None:
            pass

        def wait_event(self, ev) -> None:  # the stream stalls until the event's time
            clock["t"] = max(clock["t"], ev.t)

    monkeypatch.setattr(S.torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(S.torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(S.torch.cuda, "stream", lambda s: __import__("contextlib").nullcontext())
    monkeypatch.setattr(S.torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(S.torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(S.torch.cuda, "device", lambda device: __import__("contextlib").nullcontext())
    dev = torch.device("cuda")
    trace = S.Trace(True, dev)
    streams = S.Streams(dev, trace, None, 5.0)

    def copy(seconds: float):
        def fn() -> int:
            clock["t"] += seconds
            return 100
        return fn

    t_copy0 = clock["t"]
    loaded = streams.h2d.submit(copy(0.010), S.DONE, "load", 0)  # device: 0.000-0.010
    clock["t"] = 0.004  # compute reaches the wait at 4 ms: stalls 6 ms
    streams.wait(loaded, "forward of layer 0")
    start = trace.mark()
    clock["t"] = 0.020
    trace.add_since("compute", "fwd", 0, start)
    streams.d2h.submit(copy(0.005), (S.DONE, streams.record_compute()), "grad", 0)
    assert streams.h2d.busy_s == pytest.approx(0.010) and streams.d2h.busy_s == pytest.approx(0.005)
    assert streams.wait_s == pytest.approx(0.006)
    recs = {(r.stream, r.kind): r for r in trace.records}
    assert recs[("h2d", "load")].t_end - recs[("h2d", "load")].t_start == pytest.approx(0.010)
    assert recs[("compute", "fwd")].t_start - recs[("h2d", "load")].t_start == pytest.approx(0.010 - t_copy0)
    assert recs[("d2h", "grad")].t_start == pytest.approx(recs[("compute", "fwd")].t_end)
    streams.reset_counters()
    assert streams.wait_s == 0 and streams.h2d.busy_s == 0 and streams.h2d.bytes == 0
    for _ in range(200):  # pairs are folded as they complete: nothing piles up without a reader
        streams.h2d.submit(copy(0.001), S.DONE, "load", 1)
    assert len(streams.h2d._spans._pending) <= 65
    assert streams.h2d.busy_s == pytest.approx(0.200)


@pytest.mark.slow
def test_dry_run_sanitizer_phase_runs_the_gpus_configuration_against_its_own_reference(dry_run):
    from experiments.gpu_check.sanitizer_run import FP32_TOL, compare

    san = _phase(dry_run, "sanitizer")["checks"]["parity_under_sanitizer"]
    runs, refs = san["runs"], san["references"]
    gpu = runs["gpu_defaults"]
    assert gpu["config"] == {"compute_dtype": "bfloat16", "optimizer_overlap": True, "host_master": "hilo"}
    assert gpu["ok"] and gpu["reference"] == "bf16 mixed precision" and gpu["loss_abs"] <= gpu["tolerance"], gpu
    assert runs["fp32"]["ok"] and runs["fp32"]["tolerance"] == FP32_TOL and runs["gpu_defaults_overlap_off"]["ok"]
    # The old check (bf16 compute against the FP32 reference at 1e-5) fails this very run; like with like passes.
    assert not compare(gpu["losses"], refs["fp32"], FP32_TOL)["ok"]
    assert compare(gpu["losses"], refs["bf16 mixed precision"], gpu["tolerance"])["ok"]
    # The copy threads' ops reached the checker (the sanitizer on CUDA, a counter here).
    for name in ("gpu_defaults", "fp32"):
        assert any(k.startswith("megatrain-") for k in runs[name]["threads_checked"]), runs[name]
    par = _phase(dry_run, "parity")["checks"]["bf16_llama"]
    assert par["loss_abs_vs_mixed"] < par["loss_abs_vs_fp32"], par


@pytest.mark.slow
def test_dry_run_checks_pinned_bytes_and_runs_the_sanitizer_phase(dry_run):
    par = _phase(dry_run, "parity")["checks"]
    assert par["pinned_bytes_exact"]["ok"], par["pinned_bytes_exact"]
    for case in ("fp32_llama", "fp32_qwen2_tied"):
        c = par[case]
        assert c["param_abs_noise"] <= c["tolerance"]["param_abs_noise"] and 0 <= c["noise_share"] < 1, c
    san = _phase(dry_run, "sanitizer")["checks"]["parity_under_sanitizer"]
    assert san["ok"] and san["sanitizer"] is False, san  # no CUDA: no sanitizer, the rest as on a GPU
    names = list(dry_run["summary"]["phases"])
    assert names.index("bench") > max(names.index(n) for n in ("parity", "sync", "stress", "sanitizer"))
    assert "## Stream sanitizer" in (dry_run["out"] / "summary.md").read_text()


def test_a_completed_query_is_reported_as_a_synchronization():
    """The engine's host waits poll an event's query(); the sanitizer hears only synchronize() from torch, and
    would then flag the host's next write as racing the copy it waited for."""
    from experiments.gpu_check.every_thread import sync_on_query

    class Registry:
        def __init__(self):
            self.fired = []

        def fire_callbacks(self, *a):
            self.fired.append(a)

    class Ev:
        def __init__(self, done):
            self.done, self.cuda_event = done, 0xE1

        def query(self):
            return self.done

    reg = Registry()
    undo = sync_on_query(Ev, reg, "cuda_event")
    assert Ev(False).query() is False and reg.fired == []  # not done: no synchronization happened
    assert Ev(True).query() is True and reg.fired == [(0xE1,)]
    undo()
    Ev(True).query()
    assert reg.fired == [(0xE1,)]  # undone: the class's own query again


@pytest.mark.slow
def test_dry_run_sanitizes_and_syncs_the_stream_and_a_partial_placement(dry_run):
    """Never "auto" (on a large GPU it keeps every tiny layer): every layer streamed, and some kept beside streamed
    ones, each checked to be the placement asked for."""
    from experiments.gpu_check.sanitizer_run import PLACEMENTS, RUNS, run_name

    runs = _phase(dry_run, "sanitizer")["checks"]["parity_under_sanitizer"]["runs"]
    assert set(runs) == {run_name(c, p) for c in RUNS for p in PLACEMENTS}
    for name, r in runs.items():
        want = [1, 1] if name.endswith(", partial") else [0, 0]
        assert r["ok"] and r["kept_weights_graphs"] == want and r["recomputed_layers"] > 0, (name, r)
        assert r["placement"]["residency"] != "auto"
    loops = {k: v for k, v in _phase(dry_run, "sync")["checks"].items() if k.startswith("loop_")}
    assert {k.rsplit("_", 1)[1] for k in loops} == {"stream", "partial"}
    for name, v in loops.items():
        want = [1, 1] if name.endswith("_partial") else [0, 0]
        assert v["syncs_in_loop"] == 0 and v["kept_weights_graphs"] == want and v["recomputed_layers"] > 0, (name, v)
