"""`megatrain plan --trainable`: partial training priced beside the full plan (megatrain/planner/partial.py).
Frozen weights are held as loaded and stream without gradients back; no backward below the lowest trainable layer;
LoRA's adapters counted as PEFT counts them, resident on the device. Bad values refused by name."""

from __future__ import annotations

import json

import pytest

from megatrain.planner import plan, resolve_model
from megatrain.planner.cli import main as planner
from megatrain.planner.partial import lora_params, parse_trainable, plan_partial


@pytest.fixture(scope="module")
def full70b():
    return plan(resolve_model("llama3.1-70b"), context=2048, batch=8, hardware="h200-pcie")


def test_lora_on_a_70b_holds_the_frozen_base_in_bf16_and_sends_no_gradient_back(full70b):
    m = full70b.point.model
    lora = plan_partial(full70b, "lora:8")
    assert lora.adapter_params == lora_params(m, 8) and lora.trainable_params == 0
    assert lora.host_store_bytes == 2 * m.param_count()  # weights only, bf16 as loaded: no slab, no Adam state
    assert lora.host_bytes < 0.2 * lora.full_host_bytes
    assert lora.d2h_bytes == 0 and lora.full_d2h_bytes > 0  # the adapters' gradients stay on the device
    assert lora.h2d_bytes == full70b.time.h2d_bytes  # every layer still runs its input-gradient backward
    forward_only = full70b.point.grad_accum * full70b.time.forward_s
    assert forward_only < lora.step_s < 0.8 * lora.full_step_s
    assert lora.device_bytes > full70b.memory.device_total and lora.fits


def test_top_layers_skip_the_backward_below_them(full70b):
    top2, top40, every = (plan_partial(full70b, s) for s in ("top:2", "top:40", "1"))
    lora = plan_partial(full70b, "lora:8")
    assert top2.backward_layers == 2 and top40.backward_layers == 40 == parse_trainable("0.5", 80).layers
    assert top2.step_s < lora.step_s  # lora's backward crosses all 80 layers, top:2's only 2
    assert top2.step_s < top40.step_s < every.step_s <= every.full_step_s
    assert top2.host_bytes < top40.host_bytes < every.host_bytes <= every.full_host_bytes
    assert top2.d2h_bytes < top40.d2h_bytes < every.d2h_bytes <= every.full_d2h_bytes
    assert top2.h2d_bytes < 0.6 * top2.full_h2d_bytes  # the frozen layers below stream for the forward only
    assert top2.host_bytes < 0.2 * top2.full_host_bytes and top2.step_s < 0.4 * top2.full_step_s
    assert every.step_s > 0.95 * every.full_step_s  # only the embedding and head frozen: about the full step


def test_fp32_compute_holds_frozen_weights_in_fp32():
    pl = plan(resolve_model("llama3.1-8b"), context=1024, batch=1, hardware="h200-pcie", dtype="float32")
    assert plan_partial(pl, "lora:16").host_store_bytes == 4 * pl.point.model.param_count()


def test_adapter_count_is_peft_s():
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                                   num_attention_heads=6, num_key_value_heads=2)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(cfg), peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    counted = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_params(resolve_model(cfg), 8) == counted


@pytest.mark.parametrize("bad,why", [("lora:x", "expected a fraction"), ("lora:0", "the LoRA rank must be at least 1"),
                                     ("top:0", "K must be 1 to 80"), ("top:81", "K must be 1 to 80"),
                                     ("1.5", "a fraction must be in \\(0, 1\\]"), ("0", "a fraction must be in \\(0, 1\\]"),
                                     ("half", "expected a fraction.*top:K.*lora:R")])
def test_bad_values_are_refused_naming_them(bad, why):
    with pytest.raises(ValueError, match=f"--trainable '{bad}': {why}"):
        parse_trainable(bad, 80)


def test_the_command_prints_the_partial_plan_and_refuses_bad_values(capsys):
    args = ["plan", "--model", "llama3.1-70b", "--context", "2048", "--batch", "8", "--no-search"]
    assert planner([*args, "--trainable", "lora:8"]) == 0
    assert "trainable lora:8 (predicted): 16.4M adapter parameters" in capsys.readouterr().out
    assert planner([*args, "--trainable", "top:2", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["partial"]
    assert d["trainable"] == "top:2" and d["backward_layers"] == 2 and d["step_s"] < d["full_step_s"]
    assert planner([*args, "--trainable", "lora:eight"]) == 2
    assert "--trainable 'lora:eight': expected" in capsys.readouterr().err
    assert planner([*args, "--trainable", "top:2", "--gpus-per-node", "2"]) == 2
    assert "one GPU" in capsys.readouterr().err
    assert planner([*args, "--trainable", "top:2", "--backend", "zero3"]) == 2
    assert "drop it with --backend zero3" in capsys.readouterr().err


def test_a_sweep_refuses_trainable(capsys, tmp_path):
    from megatrain.commands.cli import main as megatrain

    spec = tmp_path / "s.yaml"
    spec.write_text("points: [{model: tiny, seq_len: 64, backend: megatrain}]\n")
    assert megatrain(["plan", "--sweep", str(spec), "--trainable", "top:1"]) == 2
    assert "--trainable prices one point's partial training; drop it with --sweep" in capsys.readouterr().err


def test_the_readme_lora_line_is_what_the_planner_prints():
    from pathlib import Path

    from megatrain.planner.memory import fmt_bytes

    pl = plan(resolve_model("120b"), context=2048, batch=8, hardware="h200-pcie")
    lora = plan_partial(pl, "lora:8")
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert "`megatrain plan --model 120b --context 2048 --batch 8 --hardware h200-pcie`" in readme
    assert f"host {fmt_bytes(lora.host_bytes)}, step {lora.step_s:.2f} s (h200-pcie)" in readme
