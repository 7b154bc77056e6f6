"""The planner on mixtures of experts: the MoE presets' counts against the transformers model classes built
on the meta device from the public config.json values, FLOPs from the active parameters and bytes from the
total, the overlap condition, and `megatrain plan` on a MoE preset and on a MoE config directory."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
from plan_cli import main  # --details: the tables these tests read

from megatrain.models.presets import PRESETS, ModelPreset
from megatrain.planner import plan
from megatrain.planner.hardware import get_hardware
from megatrain.planner.point import make_point
from megatrain.planner.shapes import resolve_model
from megatrain.planner.step_time import layer_flops, link_overlap

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# The published config.json values (the keys that set a parameter count), typed in from each model's public
# config, NOT derived from the presets: a preset whose shape is wrong disagrees with the model built from these.
_GPT_OSS = dict(hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                vocab_size=201088, num_experts_per_tok=4, attention_bias=True, tie_word_embeddings=False)
PUBLIC = {
    "gpt-oss-20b": ("gpt_oss", dict(_GPT_OSS, num_hidden_layers=24, num_local_experts=32)),
    "gpt-oss-120b": ("gpt_oss", dict(_GPT_OSS, num_hidden_layers=36, num_local_experts=128)),
    "qwen3-30b-a3b": ("qwen3_moe", dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                                        num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                                        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                                        decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)),
    "mixtral-8x22b": ("mixtral", dict(hidden_size=6144, intermediate_size=16384, num_hidden_layers=56,
                                      num_attention_heads=48, num_key_value_heads=8, vocab_size=32768,
                                      num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False)),
    # the DeltaNet head counts are the preset's stated assumption (no public config.json found); the rest is public
    "qwen3.5-122b-a10b": ("qwen3_5_moe_text", dict(
        hidden_size=3072, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=2, head_dim=256,
        vocab_size=248320, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=1024,
        shared_expert_intermediate_size=1024, linear_num_key_heads=16, linear_num_value_heads=64,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, tie_word_embeddings=False,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(48)])),
}
# Totals and active counts as the model cards publish them (billions, their rounding); active counts of
# GPT-OSS exclude the input embedding (the card's convention), ours include it.
PUBLISHED = {"gpt-oss-20b": (20.91, 3.61), "gpt-oss-120b": (116.83, 5.13), "qwen3-30b-a3b": (30.5, 3.3),
             "mixtral-8x22b": (141, 39), "qwen3.5-122b-a10b": (122, 10)}


def _meta_counts(model_type: str, keys: dict) -> tuple[int, float]:
    """(total, active) parameters of the transformers causal LM built on the meta device: active counts each
    routed-expert tensor at top_k / experts."""
    cfg = transformers.AutoConfig.for_model(model_type, **keys)
    cfg._attn_implementation = "eager"
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    experts = keys.get("num_local_experts") or keys.get("num_experts") or keys.get("n_routed_experts")
    share = keys["num_experts_per_tok"] / experts
    total = sum(t.numel() for t in model.parameters())
    active = sum(t.numel() * (share if ".experts." in name else 1.0) for name, t in model.named_parameters())
    return total, active


def _check_counts(p: ModelPreset, model_type: str, keys: dict) -> None:
    total, active = _meta_counts(model_type, keys)
    assert p.param_count() == total, f"{p.name}: preset total {p.param_count():,} vs transformers {total:,}"
    assert p.active_param_count() == active, f"{p.name}: preset active {p.active_param_count():,} vs {active:,.0f}"


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_moe_preset_counts_match_the_transformers_model(name):
    p = PRESETS[name]
    model_type, keys = PUBLIC[name]
    _check_counts(p, model_type, keys)
    card_total, card_active = PUBLISHED[name]
    assert abs(p.param_count() / 1e9 - card_total) <= 0.5 + 0.005 * card_total
    active = p.active_param_count() - (p.vocab * p.hidden if name.startswith("gpt-oss") else 0)
    assert abs(active / 1e9 - card_active) <= 0.4
    assert p.largest_layer_params() >= p.layer_params() > p.active_layer_params()


def test_the_tiny_moe_preset_builds_its_own_shape():
    """tiny-mixtral (a sweep-sized MoE point): its hf_config builds a model of the preset's count."""
    p = PRESETS["tiny-mixtral"]
    d = p.hf_config().to_dict()
    keys = {k: d[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                              "num_key_value_heads", "vocab_size", "num_local_experts", "num_experts_per_tok",
                              "tie_word_embeddings")}
    assert keys["num_local_experts"] == 4 and keys["num_experts_per_tok"] == 2
    _check_counts(p, "mixtral", keys)


def test_a_wrong_preset_shape_fails_the_comparison():
    """Negative control: one expert fewer, or the expert width off, and the counts disagree."""
    p = PRESETS["gpt-oss-120b"]
    model_type, keys = PUBLIC["gpt-oss-120b"]
    for wrong in (dataclasses.replace(p.moe, experts=127), dataclasses.replace(p.moe, top_k=2),
                  dataclasses.replace(p.moe, expert_bias=False)):
        with pytest.raises(AssertionError):
            _check_counts(p.with_(moe=wrong), model_type, keys)


_TINY = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
             intermediate_size=96)
_LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
CONFIGS = {
    "mixtral": dict(_TINY, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(_TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, mlp_only_layers=[1]),
    "qwen3_moe": dict(_TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=32,
                      decoder_sparse_step=2),
    "gpt_oss": dict(_TINY, num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                    layer_types=["sliding_attention", "full_attention"] * 2),
    "deepseek_v3": dict(_TINY, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=2,
                        first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                        qk_rope_head_dim=8, v_head_dim=12, n_group=1, topk_group=1),
    "qwen3_next": dict(_TINY, **_LINEAR, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32, head_dim=32, mlp_only_layers=[0]),
}


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_moe_config_directories_are_read_with_their_counts(model_type, tmp_path):
    keys = CONFIGS[model_type]
    transformers.AutoConfig.for_model(model_type, **keys).save_pretrained(tmp_path)
    p = resolve_model(tmp_path)
    assert p.is_moe and p.family == model_type
    _check_counts(p, model_type, keys)


def test_a_composite_qwen3_5_moe_config_is_read_from_its_text_config(tmp_path):
    text = dict(_TINY, **_LINEAR, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=32, head_dim=32)
    del text["intermediate_size"]
    transformers.AutoConfig.for_model("qwen3_5_moe", text_config=text).save_pretrained(tmp_path)
    p = resolve_model(tmp_path)
    assert p.attn.linear is not None and p.attn.linear.layers == 3 and p.moe.shared_gate
    _check_counts(p, "qwen3_5_moe_text", text)


def _dense_twin(m: ModelPreset) -> ModelPreset:
    """A dense Llama-shaped model with (about) the same total parameters as the MoE preset `m`."""
    mlp = (m.layer_params() - 2 * m.hidden - 4 * m.hidden * m.hidden) // (3 * m.hidden)
    return ModelPreset(f"dense-{m.name}", "llama", m.num_layers, m.hidden, mlp, m.heads, m.heads, m.vocab)


def test_flops_follow_active_params_and_bytes_follow_the_total():
    hw = get_hardware("h200-pcie")
    moe = PRESETS["qwen3-30b-a3b"]
    dense = _dense_twin(moe)
    assert abs(dense.param_count() / moe.param_count() - 1) < 0.02  # same total
    pm, pd = make_point(moe, 4096), make_point(dense, 4096)
    # GEMM FLOPs: 2 x active parameters per token for the MoE model, 2 x all of them for the dense one
    assert layer_flops(pm)[0] == 2.0 * moe.active_layer_params() * pm.tokens
    assert layer_flops(pd)[0] > 5 * layer_flops(pm)[0]
    # (every layer streamed and its optimizer on the host: "auto" would keep some layers' on the device)
    plm, pld = plan(moe, 4096, hardware=hw, residency="stream"), plan(dense, 4096, hardware=hw, residency="stream")
    assert pld.model_flops > 5 * plm.model_flops
    assert pld.time.layer.fwd_compute > 3 * plm.time.layer.fwd_compute
    # bytes: every expert is stored, streamed and updated
    assert plm.memory.host["master weights"] == 4 * moe.param_count()
    assert plm.time.layer.fwd_h2d == pytest.approx(moe.layer_params() * 2 / hw.link_bps)
    assert plm.time.layer.fwd_h2d == pytest.approx(pld.time.layer.fwd_h2d, rel=0.02)
    assert plm.time.h2d_bytes == pytest.approx(pld.time.h2d_bytes, rel=0.02)


def test_the_overlap_condition_takes_total_bytes_over_active_compute():
    hw = get_hardware("h200-pcie")
    moe = PRESETS["gpt-oss-120b"]
    dense = _dense_twin(moe)
    om, od = link_overlap(make_point(moe, 4096), hw), link_overlap(make_point(dense, 4096), hw)
    ratio = moe.layer_params() / moe.active_layer_params()
    assert om.crossover_tokens > 0.5 * ratio * od.crossover_tokens  # the link binds ~total/active times longer
    assert om.dense_crossover_tokens == pytest.approx(od.crossover_tokens, rel=0.15)
    assert om.link_binds and om.link_s > 10 * om.compute_s
    # past its crossover the MoE model's compute hides the link too
    assert not link_overlap(make_point(moe, int(1.2 * om.crossover_tokens) // 4096 * 4096 + 4096), hw).link_binds


def test_plan_cli_on_a_moe_preset_says_which_host_modes_fit(capsys):
    assert main(["plan", "--model", "gpt-oss-120b", "--hardware", "h200-pcie", "--compare", ""]) == 0
    out = capsys.readouterr().out
    assert "5.71G active: 4 of 128 experts" in out
    assert "each layer streams all 128 experts" in out and "the LINK binds" in out
    # the host-memory mode table: after its header (the device lines before it may name FP32 masters too: the
    # optimizer-resident layers' and the resident parameters'), before the NVMe table (which repeats the labels)
    modes = out.split("NVMe tier")[0].split("exact   B/param", 1)[1]
    rows = {line.split("  ")[2].strip(): line for line in modes.splitlines() if line.startswith("    ") and
            ("master," in line) and "exact" not in line}
    fits = {label: " yes " in line.split("TiB", 1)[1][:8] for label, line in rows.items()}
    assert len(fits) == 7
    # the default mode needs 18.3 B/param: 1.95 TiB of a 1.5 TiB host; hilo with the optimizer in backward fits
    assert not fits["fp32 master, fp32 grads"] and fits["hilo master, optimizer in backward"]


def test_plan_cli_on_a_moe_config_directory(tmp_path, capsys):
    transformers.AutoConfig.for_model("mixtral", **CONFIGS["mixtral"]).save_pretrained(tmp_path / "mixtral")
    assert main(["plan", "--model", str(tmp_path / "mixtral"), "--hardware", "cpu", "--context", "64",
                 "--compare", "", "--no-search"]) == 0
    out = capsys.readouterr().out
    assert "active: 2 of 4 experts" in out and "each layer streams all 4 experts" in out
