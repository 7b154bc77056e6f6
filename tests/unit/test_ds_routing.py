"""Which engine a `deepspeed.initialize` config trains on (integrations/hf_stage.py: `routed`): a "megatrain" section,
or `megatrain launch` (MEGATRAIN_LAUNCHED=1, whatever the config: built in code or read from a file), unless the
opt-out leaves DeepSpeed alone; and the line a run left on real DeepSpeed prints."""

from __future__ import annotations

import json

from megatrain.integrations import hf_stage, on_deepspeed


def test_under_megatrain_launch_every_config_is_routed_unless_left_on_deepspeed(tmp_path, monkeypatch):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 2}))
    plain, ours = {"train_batch_size": 2}, {"train_batch_size": 2, "megatrain": {}}
    for var in (hf_stage.LAUNCHED_ENV, on_deepspeed.GUARD_ENV):
        monkeypatch.delenv(var, raising=False)
    assert [hf_stage.routed(c) for c in (plain, str(path), ours)] == [False, False, True]
    monkeypatch.setenv(hf_stage.LAUNCHED_ENV, "1")
    assert [hf_stage.routed(c) for c in (plain, str(path), ours, None)] == [True, True, True, True]
    monkeypatch.setenv(on_deepspeed.GUARD_ENV, "0")
    assert [hf_stage.routed(c) for c in (plain, str(path))] == [False, False] and on_deepspeed.left_on_deepspeed()


def test_a_run_on_real_deepspeed_says_so_on_rank_0_only(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    on_deepspeed.announce(on_deepspeed.LEFT)
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    on_deepspeed.announce(on_deepspeed.NO_SECTION)
    err = capsys.readouterr().err
    assert err.startswith("[megatrain] DeepSpeed is training | engine: DeepSpeedEngine (real DeepSpeed) | the config "
                          'has no "megatrain" section')


def test_the_startup_hook_makes_every_real_deepspeed_initialize_say_so():
    """`python script.py` with the installed start-up hook: a config with no section, and any config with the opt-out,
    reaches real DeepSpeed, whose initialize first says which engine trains and why (here it then refuses the
    missing model: the line comes before anything of DeepSpeed's runs)."""
    import pytest
    from kit import run_python, worker_env

    pytest.importorskip("deepspeed")
    code = ("import deepspeed\n"
            "try:\n    deepspeed.initialize(model=None, config={'train_batch_size': 1})\n"
            "except Exception as e:\n    print('DeepSpeed refused:', type(e).__name__)\n")
    runs = {"no section": run_python(["-c", code], env=worker_env(drop=(on_deepspeed.GUARD_ENV,
                                                                         hf_stage.LAUNCHED_ENV)), timeout=300),
            "opt-out": run_python(["-c", code], env=worker_env(drop=(hf_stage.LAUNCHED_ENV,),
                                                               **{on_deepspeed.GUARD_ENV: "0"}), timeout=300)}
    for name, why in (("no section", 'the config has no "megatrain" section'), ("opt-out", on_deepspeed.LEFT)):
        r = runs[name]
        assert "DeepSpeed refused" in r.stdout, r.stderr[-3000:]
        lines = [ln for ln in r.stderr.splitlines() if on_deepspeed.PREFIX in ln]
        assert len(lines) == 1 and why in lines[0], (name, r.stderr[-3000:])
