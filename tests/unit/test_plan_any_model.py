"""`megatrain plan` answers for every config the engine can build, read off the model built on the meta device:
per-layer attributes (Gemma-4's per-layer head_dim), mixtures of experts without a formula reader (DeepSeek-V4 with
hyper-connections, GLM-5 with its sparse-attention indexer), and every family results/compat/compat.csv calls exact.
What it cannot read is one line naming it and exit 2, never a traceback."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from plan_cli import main  # --details: the tables these tests read

from megatrain.planner.shapes import resolve_model

ROOT = Path(__file__).resolve().parents[2]

# Gemma-4 31B's shape as published (ours, written out): 60 layers of 5376, sliding-window layers with head_dim 256
# and every sixth a global layer whose head_dim transformers sets per layer (512), no per-layer input embeddings.
GEMMA4_31B = dict(model_type="gemma4_text", hidden_size=5376, intermediate_size=21504, num_hidden_layers=60,
                  num_attention_heads=32, num_key_value_heads=16, head_dim=256, vocab_size=262144,
                  hidden_size_per_layer_input=0, sliding_window=1024, max_position_embeddings=262144,
                  tie_word_embeddings=True)


def _meta_counts(cfg) -> tuple[int, list[int]]:
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters()), [sum(p.numel() for p in layer.parameters())
                                                       for layer in model.model.layers]


def _write(tmp_path: Path, d: dict) -> Path:
    import transformers

    cfg = transformers.AutoConfig.for_model(d["model_type"], **{k: v for k, v in d.items() if k != "model_type"})
    cfg.save_pretrained(tmp_path)
    return tmp_path


def _plan(capsys, path: Path, *extra: str) -> dict:
    assert main(["plan", "--model", str(path), "--context", "2048", "--hardware", "h200-pcie", "--compare", "",
                 "--no-search", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_gemma4_31b_per_layer_head_dim_is_planned(tmp_path, capsys):
    path = _write(tmp_path / "gemma4-31b", GEMMA4_31B)
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(path)
    with pytest.raises(Exception, match="per-layer"):  # control: the global read the planner used to make
        cfg.head_dim  # noqa: B018
    m = resolve_model(path)
    total, layers = _meta_counts(cfg)
    assert m.param_count() == total and list(m.layer_sizes()) == layers
    assert len(set(layers)) == 2 and 30e9 < total < 33e9  # two layer kinds; the "31B"
    assert m.head_dim == 512  # the widest layer's heads, read off its q_proj
    d = _plan(capsys, path)
    assert d["point"]["model"] == "gemma4-31b" and "fits" in d


@pytest.mark.parametrize("model_type,total_b,active_b", [
    ("deepseek_v4", (280, 290), (12, 15)),  # DeepSeekV4Config's defaults: 284B, 13B active (6 of 256 experts)
    ("glm_moe_dsa", (740, 750), (39, 43)),  # GlmMoeDsaConfig's defaults: GLM-5, 744B, 40B active (8 of 256)
])
def test_full_size_mixtures_without_a_formula_reader_are_planned(model_type, total_b, active_b, tmp_path, capsys):
    path = _write(tmp_path / model_type, {"model_type": model_type})
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(path)
    m = resolve_model(path)
    total, layers = _meta_counts(cfg)
    assert m.param_count() == total and list(m.layer_sizes()) == layers  # hyper-connections, indexers counted
    assert total_b[0] * 1e9 < total < total_b[1] * 1e9
    assert m.is_moe and m.moe.experts == 256 and m.moe.top_k == cfg.num_experts_per_tok
    assert active_b[0] * 1e9 < m.active_param_count() < active_b[1] * 1e9  # FLOPs from the top-k experts
    d = _plan(capsys, path)
    assert d["point"]["model"] == model_type and "fits" in d
    assert main(["plan", "--model", str(path), "--context", "2048", "--hardware", "h200-pcie", "--compare", "",
                 "--no-search"]) == 0
    out = capsys.readouterr().out
    assert "fits: " in out and "mixture of experts: each layer streams all 256 experts" in out


def test_what_cannot_be_read_is_one_line_and_exit_2(tmp_path, capsys):
    """A mixture whose config names no top-k: the planner cannot count a token's FLOPs; it says which field."""
    import transformers

    cfg = transformers.OlmoeConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=176, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, num_experts=8)
    cfg.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["num_experts_per_tok"] = None
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert main(["plan", "--model", str(tmp_path), "--hardware", "cpu"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "num_experts_per_tok" in err


def _exact_types() -> list[str]:
    with open(ROOT / "results" / "compat" / "compat.csv") as f:
        return [r["model_type"] for r in csv.DictReader(f) if r["status"] == "exact"]


def test_the_compat_table_has_exact_families():
    types = _exact_types()
    assert len(types) > 100 and "llama" in types and "qwen3_moe" in types


@pytest.mark.slow
@pytest.mark.parametrize("model_type", _exact_types())
def test_plan_answers_for_every_family_the_table_calls_exact(model_type):
    """The probe's small config of each exact family, from the config the table was measured with (the study's: the
    family's default where it builds, else filled, experiments/studies/compat_configs.py): plan answers."""
    from experiments.studies.compat_configs import study_config
    from megatrain.engine.parts import probe
    from megatrain.models.lookup import resolve
    from megatrain.planner import plan

    try:  # the family's own default (a composite keeps its whole config)
        _, config = resolve(model_type)
        m = resolve_model(probe.tiny_config(config))
    except ValueError:  # a default transformers cannot build: the study's filled config, as the table built it
        _, config, _ = study_config(model_type)
        m = resolve_model(probe.tiny_config(config))
    pl = plan(m, 256, hardware="h200-pcie")
    assert pl.time.step_s > 0 and m.param_count() > 0


@pytest.mark.parametrize("top_k", [1, 3])
def test_a_mixture_whose_top_k_sits_in_a_section_is_read(top_k):
    """DBRX keeps its expert count and top-k in `ffn_config`: the plan's active parameters follow its top-k."""
    from transformers import DbrxConfig

    cfg = DbrxConfig(d_model=64, n_heads=4, n_layers=2, max_seq_len=128, vocab_size=256,
                     attn_config={"kv_n_heads": 2, "rope_theta": 10000.0},  # 5.25 reads it there
                     ffn_config={"ffn_hidden_size": 96, "moe_num_experts": 4, "moe_top_k": top_k})
    m = resolve_model(cfg)
    assert m.moe is not None and (m.moe.experts, m.moe.top_k) == (4, top_k)
    # active parameters grow with top-k: 3 of 4 experts computed is more than 1 of 4
    assert m.active_nonembed_params() < m.nonembed_params()
