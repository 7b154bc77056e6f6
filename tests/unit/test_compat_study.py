"""The compatibility study builds every type from a valid config, says "timeout" (naming the slow part) rather than
"crashed" when a probe runs out of time, and its table has no row the study could not build."""

from __future__ import annotations

import csv
import time
from pathlib import Path

import pytest
import torch

from experiments.studies import compat
from experiments.studies.compat_configs import study_config
from megatrain.engine.model import probe
from megatrain.models.lookup import resolve

ROOT = Path(__file__).resolve().parents[2]
# Types transformers' default config does not build a model from (measured at the table's transformers version).
UNBUILDABLE_DEFAULTS = ["dbrx", "dots1", "dots3_note", "emu3", "hunyuan_v1_dense", "hunyuan_v1_moe", "llama4",
                        "ministral", "nemotron", "qwen3_5", "qwen3_5_moe", "lfm2_moe", "qwen4_exp", "qwen4_exp_text",
                        "cohere_compass_text"]
# Types whose default builds, but whose size settings the probe did not shrink (a "tiny" model over its cap).
UNSHRUNK_SIZES = ["blt", "longcat_flash", "xlm", "zamba"]


def _meta(model_cls, config):
    with torch.device("meta"):
        return model_cls(config)


@pytest.mark.parametrize("model_type", UNBUILDABLE_DEFAULTS)
def test_the_default_config_does_not_build_and_the_study_config_does(model_type):
    model_cls, config = resolve(model_type)
    with pytest.raises(Exception):  # noqa: B017 - whatever transformers raises: the negative control
        _meta(model_cls, config)
    model_cls, config, filled = study_config(model_type)
    assert filled, "nothing filled, yet it builds now?"
    _meta(model_cls, config)
    probe._instantiate(model_cls, probe.tiny_config(config), meta=True)  # and so does the probe's shrink of it


@pytest.mark.parametrize("model_type", UNSHRUNK_SIZES)
def test_the_probe_shrinks_every_size_setting_of_these(model_type):
    model_cls, config, _ = study_config(model_type)
    n = sum(p.numel() for p in probe._instantiate(model_cls, probe.tiny_config(config), meta=True).parameters())
    assert n <= probe._MAX_PARAMS


def test_a_family_value_the_default_config_rejects_builds_it():
    """Gemma 4's assistant: transformers' default config fails its own validation; the study's passes it."""
    with pytest.raises(Exception):  # noqa: B017
        resolve("gemma4_assistant")
    model_cls, config, filled = study_config("gemma4_assistant")
    assert "text_config" in filled
    # built as the study builds it: the probe's shrink (the full-size default allocates ~11 GB of CPU buffers even
    # on the meta device)
    probe._instantiate(model_cls, probe.tiny_config(config), meta=True)


def test_a_probe_out_of_time_is_a_timeout_naming_the_part_running():
    def train_plain(master, batches, dtype):  # noqa: ARG001 - named as the probe's part, to be found by name
        time.sleep(5)

    v = compat._verdict(lambda: train_plain(None, None, torch.bfloat16), limit=1)
    assert v.status == "timeout"
    assert "plain PyTorch's training (bfloat16)" in v.detail and "1 s" in v.detail


def test_negative_control_a_failure_is_still_a_crash():
    def boom():
        raise RuntimeError("boom")

    assert compat._verdict(boom, limit=5).status == "crashed"


def test_per_type_time_limits():
    assert compat.time_limit("falcon_h1") > compat.time_limit("llama") == compat.TIMEOUT_S
    assert compat.time_limit("llama", scale=2.0) == 2 * compat.TIMEOUT_S


def test_no_row_of_the_table_says_the_study_could_not_build_a_small_config():
    rows = list(csv.DictReader((ROOT / "results" / "compat" / "compat.csv").open()))
    assert rows
    stuck = [r["model_type"] for r in rows if "could not build a small" in r["detail"]
             or "cannot build its default config" in r["detail"]]
    assert not stuck, stuck
