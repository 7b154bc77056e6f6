"""The planner's device-memory terms for the zero3-alst configuration (megatrain/planner/alst.py)."""

from __future__ import annotations

import pytest

from megatrain.models.presets import get_preset
from megatrain.planner.alst import LOSS_TILE_LOGIT_BYTES, default_loss_tile, zero3_alst_device_terms


def test_terms_follow_the_tiles_and_the_sequence():
    m = get_preset("smollm-135m")
    small, big = (zero3_alst_device_terms(m, 1024, loss_tile=t)["working set (layer or loss)"] for t in (256, 320))
    # At 1024 tokens the loss tile dominates: 64 more tokens of 49k FP32 logits x 12 B.
    assert big - small == 64 * m.vocab * 12
    # Past the loss tile the layer recompute grows linearly in tokens; no term holds all layers' activations.
    long = [zero3_alst_device_terms(m, t)["working set (layer or loss)"] for t in (32768, 65536)]
    per_token = (m.hidden * 13.0 + 2 * m.kv_heads * m.head_dim) * 4 + m.heads * 4  # measured, see alst.py
    assert long[1] - long[0] == pytest.approx(32768 * per_token, rel=1e-3)
    assert zero3_alst_device_terms(m, 65536)["grad reduce bucket"] == 1_000_000 * 4


def test_default_loss_tile_matches_the_backend():
    from baselines import alst
    assert alst._LOSS_TILE_LOGIT_BYTES == LOSS_TILE_LOGIT_BYTES
    assert default_loss_tile(49152) == 341


def test_bad_input():
    with pytest.raises(ValueError, match="tokens"):
        zero3_alst_device_terms(get_preset("smollm-135m"), 0)


# -- zero3-alst as a planner backend ---------------------------------------------------------------------

def test_plan_takes_zero3_alst_with_its_device_terms_and_host_checkpoints():
    from megatrain.planner import plan

    m = get_preset("smollm-135m")
    pl = plan("smollm-135m", 32768, dtype="float32", hardware="cpu", backend="zero3-alst")
    terms = zero3_alst_device_terms(m, 32768, 4)
    assert {k: pl.memory.device[k] for k in terms} == terms
    assert pl.memory.host["offloaded checkpoints"] == m.num_layers * 32768 * m.hidden * 4
    assert pl.decisions["loss_tile_tokens"] == default_loss_tile(m.vocab)
    # ZeRO-3 without the long-sequence pieces keeps full logits and all boundaries on the device
    z3 = plan("smollm-135m", 32768, dtype="float32", hardware="cpu", backend="zero3")
    assert z3.memory.device_total > 4 * pl.memory.device_total


def test_max_context_orders_the_backends_and_megatrain_reaches_a_million_on_one_h100():
    from megatrain.planner import max_context

    got = {b: max_context("llama3.1-8b", hardware="h100-sxm", backend=b) for b in ("megatrain", "zero3-alst", "zero3")}
    assert got["megatrain"] >= 1_000_000 and got["zero3-alst"] > 5 * got["zero3"], got
    assert got["megatrain"] > got["zero3-alst"], got


def test_megatrain_plan_cli_takes_zero3_alst(capsys):
    from plan_cli import main  # --details: the tables these tests read

    assert main(["plan", "--model", "smollm-135m", "--context", "8192", "--backend", "zero3-alst", "--compare", "",
                 "--no-search", "--hardware", "h100-sxm"]) == 0
    out = capsys.readouterr().out
    assert "zero3-alst" in out and "fits" in out


def test_sweep_spec_takes_zero3_alst_with_zero3_overrides(tmp_path):
    from experiments.spec import SpecError, load_sweep

    spec = tmp_path / "s.yaml"
    spec.write_text("defaults: {model: tiny, seq_len: 256}\n"
                    "points:\n  - {backend: zero3-alst, zero3: {reduce_bucket_size: 1000000}}\n  - {backend: zero3}\n")
    pts = load_sweep(spec).points
    assert pts[0].backend == "zero3-alst" and pts[0].zero3 == {"reduce_bucket_size": 1000000}
    assert "reduce_bucket_size" in pts[0].label and pts[0].point_id != pts[1].point_id
    spec.write_text("defaults: {model: tiny, seq_len: 256}\npoints:\n  - {backend: zero4}\n")
    with pytest.raises(SpecError, match="zero3-alst"):
        load_sweep(spec)
