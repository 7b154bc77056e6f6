"""The GPU check's bench measures what users ask (a streamed 7B-width point against plain PyTorch on the same
layers), and nothing in the check needs a package the GPU image lacks (pandas, DeepSpeed, TRL)."""

from __future__ import annotations

import ast
from pathlib import Path

from kit import run_python

from experiments.gpu_check import bench

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "experiments" / "gpu_check"
NOT_ON_THE_IMAGE = {"pandas", "deepspeed", "trl"}


def test_the_points_include_a_streamed_7b_width_point_and_plain_pytorch():
    points = bench.bench_points(dry=False)
    cfg = bench.model_config(dry=False)
    stream = [p for p in points if p.backend == "megatrain" and p.residency == "stream"]
    assert stream and all(p.hidden == 4096 and p.seq == 4096 for p in stream)
    assert 8 <= cfg.num_hidden_layers <= 16 and cfg.hidden_size == 4096 and cfg.intermediate_size == 11008
    assert cfg.num_attention_heads == 32 and cfg.vocab_size == 32000  # llama2-7b's shapes
    torch_points = [p for p in points if p.backend == "torch"]
    assert torch_points and torch_points[0].layers == stream[0].layers and torch_points[0].seq == stream[0].seq
    assert any(p.residency == "auto" for p in points)
    assert points[0] is stream[0]  # the question first: a cut-short bench still measured streaming


def test_the_bench_model_fits_the_lent_machines_host():
    """8 layers: the streamed point plans ~70 GiB of host memory beside the FP32 model it is built from; the
    machines lent have 128 GiB."""
    from megatrain.planner.estimate import plan

    cfg = bench.model_config(dry=False)
    p = plan(cfg, bench.SEQ, 1, hardware="h100-sxm", residency="stream", host_memory_gib=128)
    assert p.feasible, p.reasons
    assert p.memory.host_total + bench.bench_model_bytes(dry=False) < 120 * 2**30


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def test_no_module_of_the_check_imports_pandas_deepspeed_or_trl():
    files = sorted(CHECK.glob("*.py"))
    assert len(files) >= 10
    bad = {f.name: sorted(_imports(f) & NOT_ON_THE_IMAGE) for f in files if _imports(f) & NOT_ON_THE_IMAGE}
    assert not bad, bad
    # nor anything the check imports from the repository, loaded as its phases load it
    code = ("import sys, experiments.gpu_check as gc, megatrain.engine, megatrain.planner.estimate, "
            "megatrain.config.schema, megatrain.engine.parts, megatrain.metrics.provenance; "
            f"print(sorted(m for m in {sorted(NOT_ON_THE_IMAGE)!r} if m in sys.modules))")
    proc = run_python(["-c", code], check=True)
    assert proc.stdout.strip() == "[]", proc.stdout


def test_a_negative_control_the_scan_sees_an_import(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("def f():\n    import pandas as pd\n    return pd\n")
    assert "pandas" in _imports(f)


def test_rows_round_trip_without_pandas(tmp_path):
    path = tmp_path / "results.csv"
    bench.append_row(path, {"point": "stream", "status": "ok", "steps": 3, "step_time_s": 0.5, "reason": ""})
    bench.append_row(path, {"point": "torch", "status": "failed", "reason": "OOM at 1e9 bytes"})
    rows = bench.read_rows(path)
    assert rows[0]["point"] == "stream" and rows[0]["step_time_s"] == 0.5 and rows[0]["steps"] == 3.0
    assert rows[0]["reason"] is None and rows[1]["reason"] == "OOM at 1e9 bytes" and rows[1]["steps"] is None
