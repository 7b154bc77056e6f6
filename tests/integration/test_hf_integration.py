"""Hugging Face Trainer and TRL's SFTTrainer on MegaTrain (megatrain.integrations.hf), run as a user would:
the examples/ scripts, each once on plain Trainer and once on MegaTrain, compared step by step; plus the
routing rules themselves (a "megatrain" section never reaches real DeepSpeed) and the fused-LM-head outputs.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_model
from kit import finish, run_python, start_python, worker_env
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5


def _env(**extra: str) -> dict[str, str]:
    # torchrun's variables for a job of one, on a free port of its own
    return worker_env(world_size=1, threads=2, **extra)


def _run(args: list[str], tmp: Path) -> str:
    return run_python(args, cwd=tmp, env=_env(), timeout=600, check=True).stdout


def _drive(backend: str, scripts: list[str], tmp: Path) -> dict:
    out = _run([str(ROOT / "tests" / "workers" / "hf_example_driver.py"), backend, str(tmp),
                *(str(ROOT / "examples" / s) for s in scripts)], tmp)
    line = next(ln for ln in out.splitlines() if ln.startswith("REPORT "))
    return {Path(k).name: v for k, v in json.loads(line[len("REPORT "):]).items()}


def _check_trainer_run(script: str, plain: dict, full: dict, resumed: dict, tmp: Path) -> None:
    # Trained by MegaTrain's engine (not by DeepSpeed or DDP), for all 8 optimizer steps.
    assert full["engine"] == "MegaTrainEngine" and full["engine_global_steps"] == 8
    assert plain["engine"] != "MegaTrainEngine"
    steps = [str(i) for i in range(1, 9)]
    assert sorted(full["losses"], key=int) == steps and sorted(plain["losses"], key=int) == steps
    diffs = [abs(full["losses"][s] - plain["losses"][s]) for s in steps]
    assert max(diffs) <= TOL, (script, diffs)
    # Control: consecutive losses differ by far more than the tolerance, so comparing misaligned or stale
    # steps could not pass.
    moves = [abs(plain["losses"][a] - plain["losses"][b]) for a, b in zip(steps, steps[1:])]
    assert min(moves) > 10 * TOL, moves
    assert abs(full["eval_loss"] - plain["eval_loss"]) <= TOL

    # The resumed trainer restored the engine's counters and continued bit-identically.
    assert resumed["engine_global_steps"] == 8
    assert resumed["losses"] == full["losses"]
    assert resumed["eval_loss"] == full["eval_loss"]
    where = tmp / Path(script).stem
    final = load_file(where / "full" / "final" / "model.safetensors")
    again = load_file(where / "resumed" / "final" / "model.safetensors")
    assert final.keys() == again.keys()
    assert all(torch.equal(final[k], again[k]) for k in final)
    at4 = load_file(where / "full" / "checkpoint-4" / "model.safetensors")
    assert any(not torch.equal(final[k], at4[k]) for k in final), "control: training past step 4 changed nothing"
    # save_model wrote the whole model, every key plain Trainer writes (its values are what eval_loss measured).
    ref = load_file(where / "plain" / "final" / "model.safetensors")
    assert final.keys() == ref.keys()
    assert all(final[k].shape == ref[k].shape and final[k].dtype == ref[k].dtype for k in final)


SCRIPTS = ["hf_trainer.py", "trl_sft.py"]


@pytest.fixture(scope="module")
def driven(tmp_path_factory) -> tuple[dict, Path]:
    """examples/hf_trainer.py and examples/trl_sft.py on both backends, in one process (torch, transformers and TRL
    imported once), once for the module: (their reports, where they wrote)."""
    tmp = tmp_path_factory.mktemp("driven")
    return _drive("torch+megatrain", SCRIPTS, tmp), tmp


@pytest.mark.slow
def test_trainer_and_sft_trainer_on_megatrain_match_plain_save_resume_and_evaluate(driven):
    """examples/hf_trainer.py (Trainer) and examples/trl_sft.py (SFTTrainer), unchanged, on both backends."""
    runs, tmp = driven
    for script in SCRIPTS:
        _check_trainer_run(script, runs[script]["plain"], runs[script]["full"], runs[script]["resumed"], tmp)


# ---------------------------------------------------------------------------------------------------
# the routing rules, in this process


@pytest.fixture
def routed():
    import torch.distributed as dist

    from megatrain.integrations import hf
    had_group = dist.is_initialized()
    hf.install()
    yield hf
    hf.uninstall()
    if dist.is_initialized() and not had_group:
        dist.destroy_process_group()  # the one-rank group a routed initialize makes here: not for later tests


def _ds_cfg(**extra):
    return {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, **extra}


def test_a_megatrain_section_reaching_real_deepspeed_is_an_error(routed):
    from deepspeed.runtime.config import DeepSpeedConfig

    with pytest.raises(routed.MegaTrainSectionError, match="'megatrain' section"):
        DeepSpeedConfig(_ds_cfg(megatrain={}))
    DeepSpeedConfig(_ds_cfg())  # without the section real DeepSpeed parses it as before
    routed.uninstall()
    DeepSpeedConfig(_ds_cfg(megatrain={}))  # control: it is the installed guard that refuses, nothing else


def test_a_megatrain_section_in_a_json_file_is_refused_too(routed, tmp_path):
    from deepspeed.runtime.config import DeepSpeedConfig

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_ds_cfg(megatrain={"compute_dtype": "float32"})))
    with pytest.raises(routed.MegaTrainSectionError):
        DeepSpeedConfig(str(path))


def test_deepspeed_initialize_routes_by_the_section(routed):
    import deepspeed
    from accelerate.utils.deepspeed import HfDeepSpeedConfig

    from megatrain.deepspeed.deepspeed_engine import MegaTrainEngine

    engine, opt, _, _ = deepspeed.initialize(model=tiny_model(), config=_ds_cfg(megatrain={}))
    assert isinstance(engine, MegaTrainEngine) and opt is engine.optimizer
    stage3 = _ds_cfg(zero_optimization={"stage": 3})
    assert HfDeepSpeedConfig(stage3).is_zero3()
    assert not HfDeepSpeedConfig({**stage3, "megatrain": {}}).is_zero3()  # nothing is partitioned on MegaTrain
    with deepspeed.zero.Init(config_dict_or_path={**stage3, "megatrain": {}}):
        layer = torch.nn.Linear(3, 3)
    assert not hasattr(layer.weight, "ds_id")  # built whole, not partitioned by DeepSpeed


# ---------------------------------------------------------------------------------------------------
# TRL's fused LM head, served from the engine's final hidden state


def _hidden_states_of(model):
    """What the engine-run model returns to the fused head: the LM head's input, as a one-tuple."""
    def forward(input_ids, return_hidden=False, return_logits=True, **kw):
        assert return_hidden and not return_logits
        return SimpleNamespace(hidden_states=(model.model(input_ids=input_ids, **kw).last_hidden_state,), loss=None)
    return forward


def test_fused_lm_head_outputs_equal_trls_own(clone):
    from trl.trainer.utils import add_fused_lm_head

    from megatrain.backend.fused_head import fused_lm_head_forward

    model = tiny_model()
    ours_model = clone(model)
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, 12), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100
    ref = model(input_ids=ids, labels=labels, fused_lm_head=True, num_items_in_batch=17)

    engine_like = _hidden_states_of(ours_model)
    ours = fused_lm_head_forward(engine_like, ids, {"labels": labels, "num_items_in_batch": 17},
                                 head=ours_model.lm_head)
    for field in ("log_probs", "entropy"):
        torch.testing.assert_close(getattr(ours, field), getattr(ref, field), rtol=0, atol=1e-5)
    assert torch.equal(ours.is_top1.bool(), ref.is_top1.bool()) and torch.equal(ours.label_mask, ref.label_mask)
    torch.testing.assert_close(ours.loss, ref.loss, rtol=0, atol=1e-6)
    # Control: scoring unshifted labels (an off-by-one) is caught by the same comparison.
    wrong = fused_lm_head_forward(engine_like, ids, {"shift_labels": labels, "num_items_in_batch": 17},
                                  head=ours_model.lm_head)
    assert (wrong.loss - ref.loss).abs() > 1e-3


# ---------------------------------------------------------------------------------------------------
# GRPO at a sampling temperature other than 1: TRL's fused head scores at that temperature, so must the engine


@pytest.mark.slow
def test_grpo_at_temperature_0_7_matches_plain_trl(tmp_path):
    """examples/trl_grpo.py, unchanged, on plain GRPOTrainer and on MegaTrain: the same rewards (same samples)
    and the same gradient norms; a run whose fused head ignores the temperature is caught by the same check.
    The three runs share one process (tests/workers/grpo_runs.py)."""
    _run([str(ROOT / "tests" / "workers" / "grpo_runs.py"), str(tmp_path)], tmp_path)
    plain, mt, wrong = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("plain", "megatrain", "wrong"))
    assert mt["engine"] == "MegaTrainEngine" and plain["engine"] != "MegaTrainEngine"
    assert mt["rewards"] == plain["rewards"]
    steps = sorted(plain["grad_norms"], key=int)
    assert len(steps) == 3 and sorted(mt["grad_norms"], key=int) == steps
    assert all(plain["grad_norms"][s] > 0.1 for s in steps), plain  # every step's update is non-trivial
    diffs = [abs(mt["grad_norms"][s] - plain["grad_norms"][s]) for s in steps]
    assert max(diffs) <= TOL * max(plain["grad_norms"].values()), (diffs, plain, mt)
    assert max(abs(mt["losses"][s] - plain["losses"][s]) for s in steps) <= TOL
    # Control: the same MegaTrain run with the temperature dropped from the head misses by far more.
    assert wrong["engine"] == "MegaTrainEngine"
    assert max(abs(wrong["grad_norms"][s] - plain["grad_norms"][s]) for s in steps) > 100 * TOL


def test_fused_head_options_are_read_off_trls_patch_and_honoured(clone):
    """At temperature 0.7 with every output TRL offers, the engine-served fields equal TRL's own kernel's;
    the options are read off TRL's patch; an option it does not know is refused by name."""
    from trl.trainer.utils import add_fused_lm_head

    from megatrain.backend.fused_head import (
        OPTIONAL_OUTPUTS,
        FusedHeadOptions,
        fused_lm_head_forward,
        trl_head_options,
    )

    model = tiny_model()
    ours_model = clone(model)
    assert trl_head_options(model) == FusedHeadOptions()  # not patched: the defaults
    outputs = ("log_probs", *OPTIONAL_OUTPUTS)
    add_fused_lm_head(model, temperature=0.7, outputs=outputs)
    options = trl_head_options(model)
    assert options.temperature == 0.7 and options.outputs == outputs and not options.cast_lm_head_to_fp32
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (2, 10), generator=g)
    ref = model(input_ids=ids, labels=ids, fused_lm_head=True)

    engine_like = _hidden_states_of(ours_model)
    ours = fused_lm_head_forward(engine_like, ids, {"labels": ids}, options, head=ours_model.lm_head)
    for field in ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits"):
        torch.testing.assert_close(getattr(ours, field), getattr(ref, field), rtol=0, atol=1e-5)
    assert torch.equal(ours.is_top1.bool(), ref.is_top1.bool())
    # Control: at temperature 1 the same fields are far off TRL's at 0.7.
    at_one = fused_lm_head_forward(engine_like, ids, {"labels": ids}, FusedHeadOptions(outputs=outputs),
                                   head=ours_model.lm_head)
    assert (at_one.log_probs - ref.log_probs).abs().max() > 1e-2
    # An option the served head does not implement is refused, naming it.
    func = model.forward.__func__
    smuggled = func.__code__.replace(co_freevars=(*func.__code__.co_freevars[:-1], "top_k"))
    model.forward = type(model.forward)(type(func)(smuggled, func.__globals__, func.__name__, func.__defaults__,
                                                   func.__closure__), model)
    with pytest.raises(NotImplementedError, match="top_k"):
        trl_head_options(model)


# ---------------------------------------------------------------------------------------------------
# A "megatrain" section never trains on real DeepSpeed, megatrain imported or not (the installed .pth guard)


def test_the_installed_guard_is_loaded_at_startup_without_importing_megatrain():
    code = "import sys; print(sorted(type(f).__name__ for f in sys.meta_path), 'megatrain' in sys.modules)"
    out = _run(["-c", code], ROOT)
    assert "_RouteDeepSpeed" in out and out.strip().endswith("False"), out
    off = run_python(["-c", code], env=_env(MEGATRAIN_DEEPSPEED_GUARD="0"), timeout=60)
    assert "_RouteDeepSpeed" not in off.stdout  # control: the switch is honoured, so the check above can fail


@pytest.mark.slow
def test_a_plain_trainer_script_with_a_megatrain_section_trains_on_megatrain(tmp_path):
    """Nothing of megatrain imported, torchrun-style variables set: before the guard this trained on real
    DeepSpeed (DeepSpeedEngine) without a word."""
    from baselines.zero3 import default_extensions_dir

    def start(name: str, extra: dict[str, str]) -> tuple[subprocess.Popen, Path]:
        # Each run a port of its own (_env picks a free one): the two run at once, each with a process group.
        env = {**_env(), "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", default_extensions_dir())}
        (tmp_path / name).mkdir()
        with open(tmp_path / f"{name}.err", "w") as err:
            proc = start_python([ROOT / "tests" / "workers" / "plain_trainer_script.py", tmp_path / name],
                                cwd=tmp_path / name, env={**env, **extra}, stdout=subprocess.PIPE, stderr=err,
                                text=True)
        return proc, tmp_path / f"{name}.err"

    def engine(run: tuple[subprocess.Popen, Path]) -> dict:
        proc, err = run
        try:
            out, _ = proc.communicate(timeout=600)
        finally:
            proc.kill()
        assert proc.returncode == 0, err.read_text()[-4000:]
        return json.loads(next(ln for ln in out.splitlines() if ln.startswith("REPORT "))[7:])

    # The routed run and the control (the guard switched off) side by side, each in a folder of its own.
    runs = [start("routed", {}), start("unguarded", {"MEGATRAIN_DEEPSPEED_GUARD": "0"})]
    routed = engine(runs[0])
    # The script never imports megatrain (the start-up hook has, by the time the Trainer is built: at accelerate's
    # DeepSpeed module, so "imported_before" is no longer the script's doing).
    assert "import megatrain" not in (ROOT / "tests" / "workers" / "plain_trainer_script.py").read_text()
    assert routed["engine"] == "MegaTrainEngine" and len(routed["losses"]) == 2
    # Control: with the guard switched off the very same script does train on real DeepSpeed.
    assert engine(runs[1])["engine"] == "DeepSpeedEngine"


@pytest.mark.slow
def test_trainer_example_without_launcher_variables_trains_to_the_end_with_plain_losses(tmp_path, driven):
    """`python examples/hf_trainer.py` as a single-GPU user runs it: no torchrun variables. It used to stop at
    the first logging step (Trainer's nested_gather found no process group). Its losses are plain Trainer's on the
    same script and arguments (the module's run of it, `driven`)."""
    proc = start_python([ROOT / "examples" / "hf_trainer.py", "--output_dir", tmp_path / "megatrain", "--report",
                         tmp_path / "megatrain.json", "--backend", "megatrain"], cwd=tmp_path,
                        env=worker_env(threads=2), log=tmp_path / "megatrain.log")
    finish(proc, timeout=600, log=tmp_path / "megatrain.log")
    mt, plain = json.loads((tmp_path / "megatrain.json").read_text()), driven[0]["hf_trainer.py"]["plain"]
    assert plain["engine"] != "MegaTrainEngine"
    assert mt["engine"] == "MegaTrainEngine" and mt["engine_global_steps"] == 8
    steps = [str(i) for i in range(1, 9)]
    assert sorted(mt["losses"], key=int) == steps
    assert max(abs(mt["losses"][s] - plain["losses"][s]) for s in steps) <= TOL
