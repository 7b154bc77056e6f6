"""The experiment harness: specs, the isolated runner, crash-safe results, reports, the CLI.

The sweeps here run real points in real subprocesses (torch and megatrain backends; DeepSpeed's
first-use op build takes ~85 s, so zero3 is left to its own tests) on tiny shapes with one thread.
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest
import torch
import transformers
from kit import start_python

from experiments import results as R
from experiments.report import FIGURES, pick_trace
from experiments.runner import run_sweep
from experiments.spec import SpecError, load_sweep, parse_only, select
from megatrain.commands.cli import main as cli_main
from megatrain.models.presets import get_preset

REPO = Path(__file__).resolve().parents[2]
SWEEPS = REPO / "experiments" / "sweeps"


@pytest.fixture(scope="module", autouse=True)
def _isolated_cache(tmp_path_factory):
    # Measured device peaks are cached per machine; tests keep theirs out of the user's cache.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEGATRAIN_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


def write_spec(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def hf_counts(model: str) -> dict[str, int]:
    """Parameter counts from the HF model itself (on the meta device), independent of presets.py."""
    cfg = get_preset(model).hf_config()
    with torch.device("meta"):
        m = transformers.AutoModelForCausalLM.from_config(cfg)
    total = sum(p.numel() for p in m.parameters())
    embed = sum(p.numel() for n, p in m.named_parameters() if "embed_tokens" in n or "lm_head" in n)
    layers = sum(p.numel() for n, p in m.named_parameters() if ".layers." in n)
    return {"total": total, "nonembed": total - embed, "layers": layers, "L": cfg.num_hidden_layers,
            "h": cfg.hidden_size}


# --------------------------------------------------------------------------------------- specs
BAD_SPECS = [
    ("unknown_backend", "grid: {backend: [torch, zer03], model: tiny, seq_len: 64}",
     "grid.backend[1]", "unknown backend 'zer03'"),
    ("unknown_preset", "grid: {backend: torch, model: llama-9000, seq_len: 64}",
     "grid.model", "unknown model preset 'llama-9000'"),
    ("negative_batch", "grid: {backend: torch, model: tiny, seq_len: 64, micro_batch: [1, -2]}",
     "grid.micro_batch[1]", "must be a positive integer, got -2"),
    ("context_too_long", "grid: {backend: torch, model: tiny, seq_len: [64, 4096]}",
     "grid.seq_len[1]", "exceeds max_positions 2048"),
    ("context_too_long_point", "points: [{backend: torch, model: small-7m, seq_len: 8192}]",
     "points[0].seq_len", "exceeds max_positions 4096"),
    ("unknown_key", "grid: {backend: torch, model: tiny, seq_lenn: 64}",
     "grid.seq_lenn", "unknown key (did you mean 'seq_len'?)"),
    ("bad_engine_knob", "points: [{backend: megatrain, model: tiny, seq_len: 64, engine: {num_bufers: 2}}]",
     "points[0].engine", "unknown megatrain setting 'num_bufers'"),
    ("zero_steps", "defaults: {steps: 0}\ngrid: {backend: torch, model: tiny, seq_len: 64}",
     "defaults.steps", "must be a positive integer"),
    ("zero3_not_a_mapping", "grid: {backend: zero3, model: tiny, seq_len: 64, zero3: 5}",
     "grid.zero3", "zero3 must be a mapping"),
    ("zero3_fixed_stage", "points: [{backend: zero3, model: tiny, seq_len: 64, zero3: {stage: 2}}]",
     "points[0].zero3", "zero3.stage is fixed by the zero3 backend"),
]


@pytest.mark.parametrize("name,text,key,reason", BAD_SPECS, ids=[b[0] for b in BAD_SPECS])
def test_bad_spec_fails_at_load_with_file_key_reason(tmp_path, name, text, key, reason):
    spec = write_spec(tmp_path / f"{name}.yaml", text)
    with pytest.raises(SpecError) as ei:
        load_sweep(spec)
    err = ei.value
    assert err.file == str(spec) and err.key == key, str(err)
    assert reason in err.reason, str(err)
    assert str(err).startswith(f"{spec}: {key}: ")


def test_context_override_and_cli_rejects_bad_spec_before_running(tmp_path, capsys):
    ok = write_spec(tmp_path / "ok.yaml", "grid: {backend: torch, model: tiny, seq_len: [64, 4096], max_positions: 8192}")
    assert [p.seq_len for p in load_sweep(ok).points] == [64, 4096]
    bad = write_spec(tmp_path / "bad.yaml", BAD_SPECS[0][1])
    assert cli_main(["sweep", str(bad), "--out", str(tmp_path / "out")]) == 2
    assert "bad.yaml: grid.backend[1]: unknown backend" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_shipped_specs_load_and_quick_covers_the_grid():
    for name in ("quick", "paper_scaling", "paper_context", "paper_batch"):
        sweep = load_sweep(SWEEPS / f"{name}.yaml")
        assert sweep.name == name and sweep.points
    quick = load_sweep(SWEEPS / "quick.yaml").points
    assert {p.backend for p in quick} == {"megatrain", "zero3", "torch"}
    assert {"tiny", "small-7m"} <= {p.model for p in quick}
    assert len({p.seq_len for p in quick}) >= 2 and len({p.micro_batch for p in quick}) >= 2
    assert all(p.warmup >= 1 and p.steps >= 2 for p in quick)
    big = {p.model for p in load_sweep(SWEEPS / "paper_scaling.yaml").points}
    assert {"llama2-7b", "dense-120b"} <= big
    ctx = load_sweep(SWEEPS / "paper_context.yaml").points
    assert max(p.seq_len for p in ctx) == 524288 and min(p.seq_len for p in ctx) <= 1024
    assert len(select(quick, parse_only(["backend=torch", "model=small-7m"]))) == 4
    assert len(select(quick, parse_only(["backend=torch,zero3", "seq_len=128", "micro_batch=1"]))) == 6
    with pytest.raises(ValueError, match="unknown key 'bakend'"):
        parse_only(["bakend=torch"])


def test_readme_documents_exactly_the_csv_columns():
    text = (REPO / "experiments" / "README.md").read_text()
    section = text.split("### Columns", 1)[1].split("\n## ", 1)[0]
    documented = re.findall(r"^\| `([a-z0-9_]+)` \|", section, flags=re.M)
    assert documented == R.COLUMN_NAMES


# ------------------------------------------------------------------------------------- results
def test_results_append_is_crash_safe(tmp_path):
    path = tmp_path / "results.csv"
    R.append_row(path, {"point_id": "a", "status": "ok", "reason": "multi\nline, with comma"})
    R.append_row(path, {"point_id": "b", "status": "failed"})
    with open(path, "a") as f:
        f.write("sweep,c,torch/tiny,o")  # a crash mid-write: a torn last line
    df = R.read_rows(path)
    assert list(df["point_id"]) == ["a", "b"] and df.loc[0, "reason"] == "multi line, with comma"
    R.append_row(path, {"point_id": "c", "status": "ok"})
    lines = path.read_text().splitlines()
    assert len(lines) == 4 and all(len(r) == len(R.COLUMN_NAMES) for r in csv.reader(lines))
    with pytest.raises(KeyError):
        R.append_row(path, {"point_id": "d", "tokens_per_sec": 1.0})
    R.append_row(path, {"point_id": "a", "status": "failed", "threads": 2})  # a --force redo of a
    R.compact(path)
    df = R.read_rows(path, dedupe=False)
    assert sorted(df["point_id"]) == ["a", "b", "c"] and df.set_index("point_id").loc["a", "status"] == "failed"
    assert ",2," in path.read_text().splitlines()[-1]  # kept as written, not re-typed to 2.0


# --------------------------------------------------------------------------- end-to-end sweep
E2E_SPEC = """
name: e2e
defaults: {warmup: 1, steps: 2, seq_len: 64, micro_batch: 1, grad_accum: 2, threads: 1, timeout_s: 300}
grid:
  backend: [torch, megatrain]
  model: [tiny, small-7m]
points:
  - {backend: megatrain, model: dense-120b, seq_len: 64}
"""


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    d = tmp_path_factory.mktemp("e2e")
    spec = write_spec(d / "e2e.yaml", E2E_SPEC)
    out = d / "results"
    summary = run_sweep(load_sweep(spec), out_dir=out, progress=False, log=lambda *_: None)
    return out, summary, R.read_rows(out / "results.csv")


@pytest.mark.slow
def test_sweep_end_to_end_columns_and_sane_values(e2e):
    out, summary, df = e2e
    assert list(pd.read_csv(out / "results.csv").columns) == R.COLUMN_NAMES
    assert len(df) == 5 and df["point_id"].is_unique
    ok = df[df["status"] == "ok"]
    assert len(ok) == 4, df[["label", "status", "reason"]].to_string()
    for _, r in ok.iterrows():
        c = hf_counts(r["model"])
        T = 64 * 1 * 2
        assert r["params"] == c["total"] and r["nonembed_params"] == c["nonembed"] and r["tokens_per_step"] == T
        assert r["flops_per_step"] == pytest.approx(6 * c["nonembed"] * T + 12 * c["L"] * c["h"] * 64 * T * 0.5,
                                                    rel=1e-12)
        assert r["step_time_min_s"] <= r["step_time_s"] <= r["step_time_max_s"]
        assert len(json.loads(r["step_times_s"])) == 2
        assert r["tokens_per_s"] > 0 and r["tokens_per_s"] == pytest.approx(T / r["step_time_s"], rel=1e-9)
        assert r["model_tflops"] == pytest.approx(r["flops_per_step"] / r["step_time_s"] / 1e12, rel=1e-9)
        assert r["device_peak_tflops"] > 0 and r["mfu"] == pytest.approx(r["model_tflops"] / r["device_peak_tflops"])
        assert pd.notna(r["loss_first"]) and 0 < r["loss_last"] < 20
        assert r["peak_host_rss_bytes"] >= r["base_host_rss_bytes"] > 0
        assert r["host_bytes_per_param"] == pytest.approx(
            (r["peak_host_rss_bytes"] - r["base_host_rss_bytes"]) / r["params"])
        assert r["streamed_weight_bytes"] == 4 * c["layers"]
        assert r["threads"] == 1 and r["wall_s"] > r["step_time_s"]
        assert (out / r["log_file"]).exists()
        # provenance on every row
        assert r["versions"].startswith("python=") and "torch=" in r["versions"]
        assert r["cpu_model"] and r["host_mem_bytes"] == psutil.virtual_memory().total
        assert dt.datetime.fromisoformat(r["timestamp"]).tzinfo is not None
        assert isinstance(r["git_commit"], str) and r["git_commit"]
        parts = [r["forward_s"], r["backward_s"], r["optimizer_s"]]
        assert all(p > 0 for p in parts) and sum(parts) <= r["step_time_s"] * 1.05
        if r["backend"] == "megatrain":
            assert r["breakdown_source"] == "engine" and r["copy_wait_s"] >= 0
            assert r["device_mem_source"] == "engine" and r["peak_device_bytes"] >= r["device_weight_bytes"] > 0
            # "auto" residency with no device budget on a CPU device keeps every layer and its graph, none is
            # recomputed, (no link emulated) a kept layer's device copy is its host stream source, and every layer's
            # optimizer is the device's (FP32 master): no weight copied up, no gradient copied down.
            assert r["residency"] == f"{c['L']}/{c['L']}" and r["recomputed_layers"] == 0
            assert r["h2d_bytes_per_step"] == 0
            assert r["d2h_bytes_per_step"] == 0 and r["link_util"] == 0 and r["link_source"] == "engine"
            assert r["h2d_gbps"] == pytest.approx(r["h2d_bytes_per_step"] / r["step_time_s"] / 1e9)
            trace = json.loads((out / r["trace_file"]).read_text())
            assert {"compute", "h2d"} <= {rec[0] for rec in trace["records"]}
        else:
            assert r["breakdown_source"] == "wall" and r["device_mem_source"] == "none"
            assert pd.isna(r["peak_device_bytes"]) and r["link_source"] == "none"
        # Every backend at its best kernel, and the row says which ran: torch's fused AdamW (the engine
        # keeps the fused kernel on its host masters too), never the default per-tensor loop.
        assert r["optimizer"] == "torch.optim.AdamW(fused)", r["optimizer"]
        assert json.loads(r["backend_settings"]) == {}


def test_zero3_overrides_shape_identity_and_label_only_where_they_apply(tmp_path):
    spec = write_spec(tmp_path / "z.yaml", "grid: {backend: [zero3, torch], model: tiny, seq_len: 64, "
                                           "zero3: [{}, {stage3_prefetch_bucket_size: 1000}]}")
    pts = load_sweep(spec).points
    z3 = [p for p in pts if p.backend == "zero3"]
    assert len(z3) == 2 and len({p.point_id for p in z3}) == 2
    assert {p.label for p in z3} == {"zero3/tiny/s64/b1/fp32", "zero3/tiny/s64/b1/fp32/stage3_prefetch_bucket_size=1000"}
    # the overrides mean nothing to torch: one torch point, with the id it had before the key existed
    torch_pts = {p.point_id for p in pts if p.backend == "torch"}
    assert len(torch_pts) == 1
    plain = write_spec(tmp_path / "t.yaml", "grid: {backend: torch, model: tiny, seq_len: 64}")
    assert torch_pts == {load_sweep(plain).points[0].point_id}


@pytest.mark.slow
def test_point_that_cannot_fit_is_skipped_with_reason(e2e):
    _, _, df = e2e
    row = df[df["model"] == "dense-120b"].iloc[0]
    assert row["status"] == "skipped"
    assert "GiB" in row["reason"] and "available" in row["reason"], row["reason"]
    assert pd.isna(row["step_time_s"])


@pytest.mark.slow
def test_report_writes_markdown_and_every_figure(e2e, tmp_path, capsys):
    out, _, df = e2e
    assert cli_main(["report", str(out), "--out", str(tmp_path)]) == 0
    for stem in FIGURES:
        png = tmp_path / f"{stem}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000, stem
    md = (tmp_path / "report.md").read_text()
    for label in df.loc[df["status"] == "ok", "label"]:
        backend, model = label.split("/")[:2]
        assert re.search(rf"\| {backend} \| {re.escape(model)} \|", md), label
    assert "dense-120b" in md and "skipped" in md
    assert all(f"({stem}.png)" in md for stem in FIGURES)
    assert "megatrain vs the baselines" in md.lower()
    assert pick_trace(df, out) is not None  # the timeline is drawn from a real engine trace


# ------------------------------------------------------------------------- failures and resume
def test_killed_and_timed_out_points_are_recorded_and_the_sweep_completes(tmp_path):
    spec = write_spec(tmp_path / "k.yaml", """
name: k
defaults: {warmup: 0, threads: 1, backend: torch, seq_len: 32}
points:
  - {model: small-7m, steps: 200, timeout_s: 300}
  - {model: tiny, steps: 1, timeout_s: 0.5}
""")
    sweep = load_sweep(spec)
    victim = sweep.points[0]
    killed: list[int] = []

    def killer() -> None:
        me = psutil.Process()
        deadline = time.time() + 120
        while time.time() < deadline and not killed:
            for child in me.children(recursive=True):
                try:
                    if "small-7m" in " ".join(child.cmdline()) and time.time() - child.create_time() > 1.0:
                        child.send_signal(signal.SIGKILL)  # what the kernel's OOM killer does
                        killed.append(child.pid)
                except psutil.Error:
                    pass
            time.sleep(0.1)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    run_sweep(sweep, out_dir=tmp_path / "out", progress=False, log=lambda *_: None)
    t.join(timeout=5)
    df = R.read_rows(tmp_path / "out" / "results.csv").set_index("point_id")
    assert killed
    assert df.loc[victim.point_id, "status"] == "failed"
    assert "SIGKILL" in df.loc[victim.point_id, "reason"]
    assert df.loc[sweep.points[1].point_id, "status"] == "timeout"
    assert "timed out after 0.5 s" in df.loc[sweep.points[1].point_id, "reason"]


def _point_children(marker: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info.get("cmdline") or [])
        if "experiments.point" in cmd and marker in cmd:
            out.append(p)
    return out


@pytest.mark.slow
def test_interrupt_then_rerun_gives_every_point_exactly_once(tmp_path, capsys):
    spec = write_spec(tmp_path / "r.yaml", """
name: r
defaults: {warmup: 0, steps: 1, threads: 1, backend: torch, model: tiny, timeout_s: 300}
grid: {seq_len: [16, 32]}
""")
    out = tmp_path / "out"
    csv_path = out / "results.csv"
    cmd = ["-m", "megatrain.commands.cli", "sweep", str(spec), "--out", str(out), "--no-progress"]
    # A Ctrl-C from a terminal reaches a sweep with SIGINT at its default; a test process may have been left
    # ignoring it (an ignored signal stays ignored across exec, and Python then installs no KeyboardInterrupt).
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    proc = start_python(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 600  # generous: a loaded shared CPU can take a minute per point
    # Interrupt once the first point is recorded and the second one's process is running (not between them).
    while time.time() < deadline and not (len(R.read_rows(csv_path)) == 1 and _point_children(str(out))):
        assert proc.poll() is None and len(R.read_rows(csv_path)) < 2, "the sweep ended before it was interrupted"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (err, f"SIGINT ignored in the test process: {ignored}")
    n_before = len(R.read_rows(csv_path))
    assert n_before == 1  # the second point was in flight
    time.sleep(0.5)
    assert not _point_children(str(out)), "the point in flight must be stopped with the runner"
    with open(csv_path, "a") as f:
        f.write("r,deadbeef0000,torch/tiny/s16")  # and a crash mid-append on top

    args = ["sweep", str(spec), "--out", str(out), "--no-progress"]
    assert cli_main(args) == 0  # the re-run, in this process: only the start-up differs
    assert cli_main(args) == 0
    assert "already recorded" in capsys.readouterr().out
    with open(csv_path, newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == R.COLUMN_NAMES and all(len(r) == len(R.COLUMN_NAMES) for r in rows)
    ids = [r[1] for r in rows[1:]]
    assert sorted(ids) == sorted(p.point_id for p in load_sweep(spec).points)  # none missing, none twice
    assert set(R.read_rows(csv_path)["status"]) == {"ok"}

    # --force redoes a point and replaces its row; --dry-run runs nothing.
    first = R.read_rows(csv_path).set_index("seq_len").loc[16]
    assert cli_main(["sweep", str(spec), "--out", str(out), "--dry-run", "--force"]) == 0
    assert len(R.read_rows(csv_path, dedupe=False)) == 2
    assert cli_main(["sweep", str(spec), "--out", str(out), "--no-progress", "--force", "--only", "seq_len=16"]) == 0
    raw = R.read_rows(csv_path, dedupe=False)
    assert len(raw) == 2 and raw["point_id"].is_unique
    redone = raw.set_index("seq_len").loc[16]
    assert redone["timestamp"] >= first["timestamp"] and redone["step_time_s"] != first["step_time_s"]


# ------------------------------------------------------------------------------------------- CLI
def test_train_runs_one_configuration_with_progress(tmp_path, capsys):
    cfg = write_spec(tmp_path / "run.yaml", "backend: megatrain\nmodel: tiny\nseq_len: 32\nsteps: 3\nthreads: 1\nlr: 1.0e-3\n")
    assert cli_main(["train", str(cfg), "--set", "micro_batch=2", "--trace", str(tmp_path / "t.json")]) == 0
    cap = capsys.readouterr()
    summary = cap.out.strip().splitlines()[-1]
    assert summary.startswith("megatrain/tiny/s32/b2/fp32: loss ")
    first, last = map(float, re.findall(r"loss ([\d.]+) -> ([\d.]+)", summary)[0])
    assert last < first  # three AdamW steps on a fixed batch lower its loss
    assert "tok/s" in cap.err and "3/3" in cap.err  # the progress bar: steps, loss, throughput, memory
    assert json.loads((tmp_path / "t.json").read_text())["records"]
    bad = write_spec(tmp_path / "bad.yaml", "backend: megatrain\nmodel: tiny\nseq_len: 32\n")
    assert cli_main(["train", str(bad), "--set", "micro_batch=0"]) == 2
    assert "--set micro_batch: micro_batch must be a positive integer" in capsys.readouterr().err


def test_cli_registers_the_planner_commands():
    from megatrain.commands.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert {"sweep", "report", "train", "plan", "bench"} <= set(sub.choices)


# --------------------------------------------------------------------------------------- metrics
def test_device_peaks_rss_sampler_and_nvml_fallback():
    from megatrain.metrics.device import device_peak_tflops, table_peak_tflops
    from megatrain.metrics.samplers import NvmlPcieSampler, RssSampler

    assert table_peak_tflops("NVIDIA GH200 480GB", "bf16") == table_peak_tflops("NVIDIA H200", "bf16") == 989.4
    assert table_peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    assert table_peak_tflops("NVIDIA A100-SXM4-80GB", "fp32") == 19.5
    assert table_peak_tflops("Some Future GPU", "bf16") is None
    peak, src = device_peak_tflops("cpu", "fp32")
    assert src == "measured" and peak > 0 and device_peak_tflops("cpu", "fp32") == (peak, "measured")  # cached

    rss = RssSampler().start()
    base = rss.rss()
    block = torch.ones(200 * 2**20 // 4)  # 200 MiB, touched
    del block
    assert rss.stop() - base >= 150 * 2**20

    if not torch.cuda.is_available():
        nv = NvmlPcieSampler().start()
        nv.stop()
        assert not nv.available and nv.bytes_between(0.0, 1.0) is None


def test_built_models_have_the_presets_parameter_count():
    """A tied preset is built tied: the fast init skips HF's weight tying, which once made every tied
    model in the sweeps a bigger, untied one."""
    from experiments.point import build_model
    from experiments.spec import Point

    for name in ("tiny", "tiny-qwen2"):
        pt = Point(backend="megatrain", model=name, seq_len=16)
        model = build_model(pt)
        assert sum(p.numel() for p in model.parameters()) == pt.preset.param_count(), name
    tied = build_model(Point(backend="megatrain", model="tiny-qwen2", seq_len=16))
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
