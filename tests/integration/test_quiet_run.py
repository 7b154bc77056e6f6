"""A normal `megatrain train --config` run says nothing from MegaTrain's own plumbing: no accumulation "mismatch"
note, no FutureWarning from a call MegaTrain makes (transformers 5.25's checkpointing renames), no DeepSpeed key
named as ignored that the user never wrote (accelerate's zero_allow_untested_optimizer), no stage the user did not
set (accelerate's ZeRO-3 init-flag warning for a stage-3 config MegaTrain reads as stage 2)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from kit import run_python, worker_env

ROOT = Path(__file__).resolve().parents[2]
NOISE = ("Gradient accumulation steps mismatch", "FutureWarning", "zero_allow_untested_optimizer",
         "Zero3 Init flag", "is deprecated")


@pytest.mark.slow
def test_a_train_run_has_no_warning_of_ours(tmp_path):
    sets = (f"output_dir={tmp_path / 'run'}", "report=null", "max_steps=2", "eval_data=null")
    r = run_python(["-m", "megatrain.commands.cli", "train", "--config", str(ROOT / "examples" / "sft" / "sft.yaml"),
                    *(a for s in sets for a in ("--set", s))], env=worker_env(threads=2), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "MegaTrain is training" in r.stderr and "turned off: HF gradient checkpointing" in r.stderr
    said = [n for n in NOISE if n in r.stderr]
    assert not said, (said, r.stderr[-3000:])


@pytest.fixture
def stage_reading():
    """MegaTrain's stage reading installed for the test (another test may have uninstalled it: importing
    megatrain.integrations.hf again is a no-op), and no DeepSpeed config left global after it: a stage-3
    HfDeepSpeedConfig kept alive (a failed test's frame holds it) would turn on transformers' zero.Init for every
    later from_pretrained in this process. Nor the one-rank process group a plugin for a megatrain config makes
    (as a launcher-less script needs it): left behind, every later test of this process ran as rank 0 of a job
    (deepspeed.comm's broadcast from rank 1 met gloo's "invalid root rank")."""
    import torch.distributed as dist
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from megatrain.integrations import hf_stage

    was = hf_stage.installed()
    had_group = dist.is_initialized()
    hf_stage.install()
    yield
    unset_hf_deepspeed_config()
    if not was:
        hf_stage.uninstall()
    if dist.is_initialized() and not had_group:
        dist.destroy_process_group()


def test_the_zero3_init_flag_warning_is_not_passed_on_for_a_megatrain_config(monkeypatch, stage_reading):
    from accelerate.utils.dataclasses import DeepSpeedPlugin

    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO3_INIT", "true")  # as axolotl sets it for a stage-3 config
    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    with warnings.catch_warnings(record=True) as ours:
        warnings.simplefilter("always")
        plugin = DeepSpeedPlugin(hf_ds_config={**ds, "megatrain": {}})
    assert plugin.zero_stage == 2 and not [w for w in ours if "Zero3 Init flag" in str(w.message)]
    # Control: a config without the section, whose stage 2 the user did set, still gets accelerate's warning
    with warnings.catch_warnings(record=True) as theirs:
        warnings.simplefilter("always")
        DeepSpeedPlugin(hf_ds_config={**ds, "zero_optimization": {"stage": 2}})
    assert [w for w in theirs if "Zero3 Init flag" in str(w.message)]


def test_keys_the_trainers_add_are_not_named_as_ignored():
    from megatrain.config.deepspeed import parse_config

    base = {"train_micro_batch_size_per_gpu": 1, "megatrain": {"device": "cpu"}}
    assert parse_config({**base, "zero_allow_untested_optimizer": True}, warn=False).ignored == ()
    assert parse_config({**base, "wandb": {}}, warn=False).ignored == ("wandb",)  # control: a key the user wrote


def test_auto_in_the_megatrain_section_is_left_to_megatrain_by_accelerate(stage_reading):
    """accelerate fills each "auto" of a DeepSpeed config from Trainer's values and refuses one it has none for;
    `megatrain.host_master: auto` (the default, written out) is MegaTrain's to resolve, not accelerate's."""
    from accelerate.utils.dataclasses import DeepSpeedPlugin

    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
          "megatrain": {"host_master": "auto", "residency": "auto"}}
    plugin = DeepSpeedPlugin(hf_ds_config=ds)
    plugin.deepspeed_config_process(must_match=False, gradient_clipping=1.0)  # no "megatrain.host_master not found"
    assert plugin.deepspeed_config["megatrain"] == {"host_master": "auto", "residency": "auto"}
    # Control: an "auto" of DeepSpeed's own keys is still accelerate's to fill, and refused without a value
    other = DeepSpeedPlugin(hf_ds_config={**ds, "gradient_clipping": "auto"})
    with pytest.raises(ValueError, match="gradient_clipping"):
        other.deepspeed_config_process(must_match=False)
