"""`megatrain train --set`: a dotted key sets one key inside its section, a mapping merges into the section;
a resume accepts changes to the engine settings that cannot change a computed value and names the rest."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatrain.commands.sft import load_run
from megatrain.commands.sft_resume import RESUMABLE_ENGINE_CHANGES, _changes

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "sft" / "sft.yaml"


def test_a_dotted_key_merges_into_the_section():
    base = load_run(EXAMPLE).megatrain
    assert base and "num_buffers" not in base
    run = load_run(EXAMPLE, ["megatrain.num_buffers=3"])
    assert run.megatrain == {**base, "num_buffers": 3}  # the file's host_master and the rest kept
    nested = load_run(EXAMPLE, ["megatrain.residency.weights=2", "megatrain.residency.activations=1"])
    assert nested.megatrain["residency"] == {"weights": 2, "activations": 1}
    mapped = load_run(EXAMPLE, ['megatrain={"num_buffers": 3}'])
    assert mapped.megatrain == {**base, "num_buffers": 3}  # a mapping merges too: nothing of the file's lost


def test_a_dotted_key_into_a_value_that_is_no_section_is_named():
    with pytest.raises(ValueError, match=r"learning_rate is 0.001, not a section"):
        load_run(EXAMPLE, ["learning_rate.x=1"])
    with pytest.raises(ValueError, match="unknown megatrain setting 'num_bufers'"):
        from megatrain.commands.sft import prepare  # noqa: F401  the section's keys are checked as before
        from megatrain.config.schema import EngineConfig

        EngineConfig.from_dict(load_run(EXAMPLE, ["megatrain.num_bufers=3"]).megatrain)


def test_a_resume_names_only_the_changes_that_change_results():
    was = {"learning_rate": 1e-3, "save_steps": 2, "megatrain": {"host_master": "fp32", "num_buffers": 2}}
    assert _changes(was, {**was, "save_steps": 5, "megatrain": {"host_master": "fp32", "num_buffers": 3,
                                                                "trace": True, "residency": "stream"}}) == []
    changed = _changes(was, {**was, "megatrain": {"host_master": "hilo", "num_buffers": 3}})
    assert changed == ["megatrain.host_master: 'fp32' -> 'hilo'"]
    assert _changes(was, {**was, "megatrain": {"num_buffers": 2}}) == ["megatrain.host_master: 'fp32' -> None"]


def test_every_resumable_engine_setting_is_a_setting_and_listed_in_the_docs():
    from megatrain.config.schema import ENGINE_KEYS

    assert RESUMABLE_ENGINE_CHANGES <= ENGINE_KEYS
    doc = (ROOT / "docs" / "SETTINGS.md").read_text()
    section = doc.split("## Resuming with changed settings", 1)[1].split("\n## ", 1)[0]
    assert all(f"`{k}`" in section for k in RESUMABLE_ENGINE_CHANGES)
