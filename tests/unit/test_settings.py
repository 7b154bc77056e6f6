"""One config, read one way: the typed face settings, the engine knobs under the planner's names, and the
one key check (with its did-you-mean) behind every reader."""

from __future__ import annotations

import pytest

from megatrain.commands.plan import sweep_points
from megatrain.config.deepspeed import parse_config
from megatrain.config.resolve import engine_config_from
from megatrain.config.schema import EngineConfig
from megatrain.config.settings import ConfigSettings, planner_knobs, read_config
from megatrain.config.validate import check_keys, close_match, unknown_key


def test_the_validator_finds_the_first_unknown_key_and_its_closest_spelling():
    assert unknown_key({"num_buffers": 2, "trase": True, "x": 1}, EngineConfig.__dataclass_fields__) == ("trase", "trace")
    assert unknown_key({"num_buffers": 2}, ["num_buffers"]) is None
    assert close_match("zzzz", ["num_buffers"]) is None
    with pytest.raises(KeyError, match="'b' 'bb'"):
        check_keys({"a": 1, "b": 2}, ["a", "bb"], lambda k, close: KeyError(f"{k!r} {close!r}"))


def test_read_config_says_what_a_face_reads():
    assert read_config(None) == ConfigSettings(None, 0.0, None, frozenset())
    s = read_config({"bf16": {"enabled": True}, "gradient_accumulation_steps": 4, "megatrain": {"compute_dtype": "bfloat16"}})
    assert (s.bf16, s.gradient_clipping, s.gradient_accumulation_steps) == (True, 1.0, 4)  # DeepSpeed's clip default
    assert s.engine_keys == {"compute_dtype"} and read_config(s) is s
    auto = read_config({"bf16": {"enabled": "auto"}, "gradient_clipping": "auto", "gradient_accumulation_steps": "auto"})
    assert (auto.bf16, auto.gradient_clipping, auto.gradient_accumulation_steps) == (None, 0.0, None)
    ec = read_config(EngineConfig(compute_dtype="bfloat16"))
    assert ec.bf16 is True and "compute_dtype" in ec.engine_keys
    with pytest.raises(ValueError, match="gradient_clipping=-1.0 must be >= 0"):
        read_config({"gradient_clipping": -1})


def test_engine_config_from_a_face_config_is_the_deepspeed_parsers():
    d = {"bf16": {"enabled": "auto"}, "gradient_clipping": "auto", "megatrain": {"num_buffers": 3}}
    assert engine_config_from(d) == parse_config({"train_micro_batch_size_per_gpu": 1,
                                                  "megatrain": {"num_buffers": 3}}).engine
    assert engine_config_from(None) == EngineConfig()


def test_planner_knobs_are_the_engine_settings_under_the_planners_names():
    # the planner's point takes EngineConfig's names (host_master was its `master`)
    kw = planner_knobs({"host_master": "hilo", "tile_tokens": 64, "link_gbps": 2, "trace": True, "num_buffers": 3})
    assert kw == {"host_master": "hilo", "mlp_tile_tokens": 64, "link_gbs": 2.0, "num_buffers": 3}


def test_every_reader_refuses_a_misspelt_engine_setting_the_same_way(tmp_path):
    want = r"unknown megatrain setting 'num_bufers' \(did you mean 'num_buffers'\?\)"
    with pytest.raises(ValueError, match=want):
        EngineConfig.from_dict({"num_bufers": 2})
    with pytest.raises(ValueError, match=want):
        parse_config({"train_batch_size": 1, "megatrain": {"num_bufers": 2}})
    with pytest.raises(ValueError, match=want):
        planner_knobs({"num_bufers": 2})
    spec = tmp_path / "s.yaml"
    spec.write_text("defaults: {backend: megatrain, model: tiny, seq_len: 64}\npoints: [{}]\ngird: {}\n")
    with pytest.raises(ValueError, match=r"unknown top-level key\(s\) \['gird'\] \(did you mean 'grid'\?\); known"):
        sweep_points(spec)
