"""`megatrain plan --model PATH`: the planner from the user's own model directory or config.json, a context the
engine would refuse reported as "does not fit" with the reason, and the mode table's settings valid keys of
the "megatrain" config section."""

from __future__ import annotations

import json

import pytest
from plan_cli import main  # --details: the tables these tests read

from megatrain.planner import plan
from megatrain.planner.shapes import is_model_path, model_from_path

LIMIT = 2048  # the tiny model's max_position_embeddings


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama written as a user's checkpoint directory is (save_pretrained: config.json and weights)."""
    import transformers

    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=176, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=LIMIT,
                                   tie_word_embeddings=True)
    d = tmp_path_factory.mktemp("models") / "my-llama"
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    return d


def _plan_json(capsys, *args: str) -> dict:
    assert main(["plan", *args, "--hardware", "cpu", "--dtype", "float32", "--json", "--compare", ""]) == 0
    return json.loads(capsys.readouterr().out)


def test_model_directory_and_config_json_plan_the_same_shape(model_dir, capsys):
    m = model_from_path(model_dir)
    assert (m.name, m.num_layers, m.hidden, m.intermediate, m.heads, m.kv_heads, m.vocab, m.max_positions,
            m.tie_embeddings) == ("my-llama", 2, 64, 176, 4, 2, 256, LIMIT, True)
    assert model_from_path(model_dir / "config.json") == m
    # the same numbers as the tiny preset of that shape (tiny differs only in being untied)
    from megatrain.models.presets import get_preset

    assert m.layer_params() == get_preset("tiny").layer_params()
    d = _plan_json(capsys, "--model", str(model_dir), "--context", "128", "--no-search")
    assert d["fits"] and d["point"]["model"] == "my-llama"
    assert d["point"]["model"] == _plan_json(capsys, "--model", str(model_dir / "config.json"), "--context", "128",
                                             "--no-search")["point"]["model"]
    assert is_model_path(str(model_dir)) and not is_model_path("7b") and not is_model_path("tiny")


def test_context_beyond_the_models_positions_does_not_fit(model_dir, capsys):
    ok = _plan_json(capsys, "--model", str(model_dir), "--context", str(LIMIT))
    assert ok["fits"] and not ok["refused"] and ok["max_context"] == LIMIT  # control: at the limit it fits
    over = _plan_json(capsys, "--model", str(model_dir), "--context", str(2 * LIMIT))
    assert over["memory_fits"] and not over["fits"]  # memory alone would fit: the engine is what refuses
    assert any("max_position_embeddings" in r and "DOES NOT FIT" in r for r in over["refused"])
    assert over["max_batch"] == 0 and over["max_context"] == LIMIT
    # the mode table's limits are this model's: its longest context in each mode stops at its positions
    assert {m["max_context"] for m in ok["modes"] if m["refused"] is None} == {LIMIT}
    assert main(["plan", "--model", str(model_dir), "--context", str(2 * LIMIT), "--hardware", "cpu",
                 "--dtype", "float32", "--compare", ""]) == 0
    out = capsys.readouterr().out
    assert "fits: NO" in out and f"exceeds the model's max_position_embeddings {LIMIT:,}" in out


def test_the_issues_long_context_point_on_a_4k_preset_is_refused(capsys):
    d = json.loads(_cli_out(capsys, "--model", "7b", "--context", "524288", "--hardware", "gh200", "--json",
                            "--no-search", "--compare", ""))
    assert d["memory_fits"] and not d["fits"] and "max_position_embeddings 4,096" in d["refused"][0]
    pl = plan("7b", 524288, hardware="gh200")
    assert pl.fits and not pl.feasible  # Plan.fits is memory alone; feasible is the verdict
    assert plan("7b", 4096, hardware="gh200").feasible
    row = pl.to_row()
    assert row["status"] == "skipped" and "max_position_embeddings" in row["reason"]


def test_a_mode_the_engine_refuses_does_not_fit_either(capsys):
    pl = plan("7b", 1024, grad_accum=2, hardware="h200-pcie", optimizer_in_backward=True, grad_clip=False)
    assert pl.fits and not pl.feasible and "accumulation" in pl.refused[0]
    out = _cli_out(capsys, "--model", "7b", "--context", "1024", "--grad-accum", "2", "--optimizer-in-backward",
                   "--hardware", "h200-pcie", "--no-search", "--compare", "")
    assert "fits: NO" in out and "optimizer_in_backward refuses gradient accumulation" in out


def _cli_out(capsys, *args: str) -> str:
    assert main(["plan", *args]) == 0
    return capsys.readouterr().out


def test_rope_scaling_extends_the_limit_as_the_engine_does(tmp_path):
    import transformers

    from megatrain.engine.layer.batch import max_trainable_positions

    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=176, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=1024,
                                   rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})
    cfg.save_pretrained(tmp_path)
    assert model_from_path(tmp_path).max_positions == max_trainable_positions(cfg) == 4096


def test_what_the_planner_cannot_describe_is_refused_by_name(tmp_path, capsys):
    import transformers

    # a mixture of experts without a formula reader (moe_shapes.py) is measured off its model, not refused
    transformers.OlmoeConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=176, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=256, num_experts=8,
                             num_experts_per_tok=2).save_pretrained(tmp_path / "moe")
    assert main(["plan", "--model", str(tmp_path / "moe"), "--hardware", "cpu", "--no-search", "--compare", ""]) == 0
    assert "2 of 8 experts" in capsys.readouterr().out
    assert main(["plan", "--model", str(tmp_path / "missing"), "--hardware", "cpu"]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["plan", "--model", str(tmp_path / "empty"), "--hardware", "cpu"]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_printed_settings_are_valid_megatrain_config_keys(model_dir, capsys):
    """Every settings line the plan prints parses back through EngineConfig and the DeepSpeed config parser,
    and the mode table's rows say the modes by those keys."""
    from megatrain.config.deepspeed import parse_config
    from megatrain.config.schema import EngineConfig, check_host_modes

    out = _cli_out(capsys, "--model", str(model_dir), "--context", "256", "--hardware", "h200-pcie", "--compare", "")
    plan_line = next(line for line in out.splitlines() if '"megatrain" config section for this plan:' in line)
    mode_lines = [line.strip() for line in out.splitlines() if line.strip().startswith('"megatrain": {')]
    assert len(mode_lines) == 7
    sections = [json.loads(plan_line.split("plan: ", 1)[1])]
    seen = set()
    for line in mode_lines:
        body, _, tail = line[len('"megatrain": '):].partition("}")
        sec = json.loads(body + "}")
        sections.append(sec)
        seen.add((sec["host_master"], sec["host_grad_dtype"], sec["optimizer_in_backward"]))
        no_clip = sec["optimizer_in_backward"]
        assert ('"gradient_clipping": 0' in tail) == no_clip
        ds = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "megatrain": sec,
              **({"gradient_clipping": 0} if no_clip else {})}
        assert parse_config(ds, warn=False).engine.host_master == sec["host_master"]
    assert ("hilo", "bfloat16", False) in seen and ("hilo", "float32", True) in seen and len(seen) == 7
    for sec in sections:
        cfg = EngineConfig.from_dict({"compute_dtype": "bfloat16", **sec})
        check_host_modes(cfg)
    # JSON carries the same settings
    d = json.loads(_cli_out(capsys, "--model", str(model_dir), "--context", "256", "--hardware", "h200-pcie",
                            "--compare", "", "--json", "--no-search"))
    assert d["settings"] == sections[0]
    assert [m["settings"] for m in d["modes"]] == sections[1:]


def test_train_takes_the_model_directory_too(model_dir, tmp_path, capsys):
    """`megatrain train --model PATH`: the run's model is the directory's shape (random weights), validated
    like a preset: a sequence beyond its positions is refused before anything is built."""
    from experiments.spec import SpecError, load_point_config
    from megatrain.commands.cli import main as cli_main

    cfg = tmp_path / "run.yaml"
    cfg.write_text("backend: megatrain\nmodel: tiny\nseq_len: 32\nsteps: 2\nthreads: 1\nlr: 1.0e-3\n")
    pt = load_point_config(cfg, overrides=[f"model={json.dumps(str(model_dir))}"])
    assert pt.preset == model_from_path(model_dir)
    with pytest.raises(SpecError, match=f"exceeds max_positions {LIMIT}"):
        load_point_config(cfg, overrides=[f"model={json.dumps(str(model_dir))}", f"seq_len={2 * LIMIT}"])
    assert cli_main(["train", str(cfg), "--model", str(model_dir)]) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith(f"megatrain/{model_dir}/s32/b1/fp32: loss ")


# ---------------------------------------------------------------------------------------------------
# any dense decoder-only config: the shape read off the model transformers builds on the meta device


def _meta_count(cfg) -> int:
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


def test_plan_model_on_a_dense_qwen3_config_json(tmp_path, capsys):
    """The issue's case: a dense Qwen3 config.json (q/k norms, head_dim 128 != hidden / heads) was refused by a
    list of model types; now planned from the model's own counts."""
    import transformers

    cfg = transformers.Qwen3Config(hidden_size=256, intermediate_size=768, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=128, vocab_size=1000, max_position_embeddings=4096,
                                   tie_word_embeddings=True)
    cfg.save_pretrained(tmp_path / "my-qwen3")
    m = model_from_path(tmp_path / "my-qwen3" / "config.json")
    assert m.param_count() == _meta_count(cfg)  # every parameter the engine will store, counted
    assert (m.head_dim, m.attn.qk_norm, m.heads, m.kv_heads, m.intermediate, m.tie_embeddings) == (128, True, 4, 2, 768,
                                                                                                   True)
    # Control: Llama's formulas for the same numbers (hidden / heads = 64, no q/k norms) count another model.
    from megatrain.models.presets import ModelPreset

    llama_like = ModelPreset("x", "llama", 3, 256, 768, 4, 2, 1000, tie_embeddings=True)
    assert llama_like.param_count() != m.param_count()
    d = _plan_json(capsys, "--model", str(tmp_path / "my-qwen3"), "--context", "512", "--no-search")
    assert d["fits"] and d["point"]["model"] == "my-qwen3"
    assert main(["plan", "--model", str(tmp_path / "my-qwen3"), "--context", "512", "--hardware", "h200-pcie",
                 "--compare", "", "--no-search"]) == 0
    assert "fits: yes" in capsys.readouterr().out


@pytest.mark.parametrize("make", [
    # per-layer parts Llama's formulas do not have: OLMo-2's norms over whole q/k projections and after each block
    lambda t: t.Olmo2Config(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=256),
    # Gemma-2: four norms per layer, head_dim 32 != hidden / heads, a tied head, sliding-window layers
    lambda t: t.Gemma2Config(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=32, vocab_size=256, sliding_window=64),
    # biases on every attention projection and the MLP (Llama with attention_bias and mlp_bias)
    lambda t: t.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=256, attention_bias=True, mlp_bias=True),
], ids=["olmo2", "gemma2", "llama-biases"])
def test_any_dense_decoder_is_counted_as_built(make, tmp_path):
    import transformers

    cfg = make(transformers)
    cfg.save_pretrained(tmp_path)
    m = model_from_path(tmp_path)
    assert m.param_count() == _meta_count(cfg) and len(m.layer_sizes()) == 2
    # Control: ModelPreset's formulas over the same widths miss parts of these layers, so only the reading off
    # the built model gets the count right.
    from dataclasses import fields

    from megatrain.models.presets import ModelPreset

    formulas = ModelPreset(**{f.name: getattr(m, f.name) for f in fields(ModelPreset)})
    assert formulas.param_count() != m.param_count()
    assert plan(m, 256, hardware="h200-pcie").fits


def test_a_model_that_is_not_a_causal_lm_is_refused_by_name(tmp_path, capsys):
    import transformers

    transformers.T5Config(d_model=64, d_ff=128, num_layers=2, num_heads=4, vocab_size=256).save_pretrained(tmp_path)
    assert main(["plan", "--model", str(tmp_path), "--hardware", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "'t5'" in err and "causal LM" in err
