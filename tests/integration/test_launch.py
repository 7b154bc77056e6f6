"""`megatrain launch`: an unchanged script (and its torchrun-style ranks) runs with MegaTrain's DeepSpeed routing
installed before its first line; TRL's DPOTrainer and GRPOTrainer examples, run through it without launcher
variables (how single-GPU users start), train with plain TRL's losses and gradient norms."""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import pytest
from kit import probes, start_python, worker_env

from megatrain.commands.launch import main as launch_main

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5
_LAUNCHER_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                  "GROUP_RANK", "TORCHELASTIC_RUN_ID")


def _bare_env() -> dict[str, str]:
    """This environment without any launcher variable, megatrain importable from this checkout."""
    from baselines.zero3 import default_extensions_dir

    env = worker_env(drop=_LAUNCHER_VARS, threads=2)
    env.setdefault("TORCH_EXTENSIONS_DIR", default_extensions_dir())
    return env


def _start(args: list[str], cwd: Path) -> tuple[subprocess.Popen, Path, Path]:
    """The process and the files its stdout and stderr go to (files, not pipes: a process started beside
    another never blocks on a full pipe nobody reads yet)."""
    with tempfile.NamedTemporaryFile("w", suffix=".out", dir=cwd, delete=False) as out, \
            tempfile.NamedTemporaryFile("w", suffix=".err", dir=cwd, delete=False) as err:
        proc = start_python(args, cwd=cwd, env=_bare_env(), stdout=out, stderr=err)
    return proc, Path(out.name), Path(err.name)


def _finish(run: tuple[subprocess.Popen, Path, Path]) -> str:
    proc, out, err = run
    try:
        proc.wait(timeout=900)
    finally:
        proc.kill()
    assert proc.returncode == 0, out.read_text()[-3000:] + err.read_text()[-5000:]
    return out.read_text()


def _start_launch(args: list[str], cwd: Path) -> tuple[subprocess.Popen, Path, Path]:
    return _start(["-m", "megatrain.commands.cli", "launch", *args], cwd)


# ---------------------------------------------------------------------------------------------------
# the command line


def test_a_missing_script_and_a_bad_process_count_are_refused_by_name(tmp_path, capsys):
    script = tmp_path / "s.py"
    script.write_text("raise SystemExit(7)\n")
    assert launch_main([str(tmp_path / "nope.py")]) == 2
    assert "no such script" in capsys.readouterr().err
    for bad in ("0", "-2", "two"):
        assert launch_main(["--nproc-per-node", bad, str(script)]) == 2
        assert "--nproc-per-node must be a positive integer" in capsys.readouterr().err
    assert launch_main([]) == 2
    assert "no script given" in capsys.readouterr().err
    assert launch_main(["--no-python", str(script)]) == 2
    # Control: a runnable line gets as far as the script, whose exit status comes back.
    assert launch_main([str(script)]) == 7


_PROBE = """
import json, os, sys
routed = "megatrain.integrations.hf" in sys.modules  # the script's first line: what was installed before it
print("PROBE " + json.dumps({"routed": routed, "argv": sys.argv[1:], "rank": os.environ.get("RANK"),
                             "world": os.environ.get("WORLD_SIZE"), "main": __name__, "path0": sys.path[0]}))
"""


@pytest.mark.slow
def test_launch_installs_the_routing_before_the_script_in_one_process_and_in_every_rank(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(_PROBE)
    # The three runs below start side by side (each only prints its probe).
    runs = [_start_launch([str(script), "--x", "1"], tmp_path),
            _start_launch(["--nproc-per-node", "2", str(script), "--x", "1"], tmp_path),
            _start([str(script), "--x", "1"], tmp_path)]
    one_out, two_out, plain_out = (_finish(run) for run in runs)
    # No launcher options: this one process, as `python probe.py`: no launcher variables.
    (one,) = probes(one_out)
    assert one == {"routed": True, "argv": ["--x", "1"], "rank": None, "world": None, "main": "__main__",
                   "path0": str(tmp_path)}
    # Two ranks through torch's elastic launcher, each with torchrun's variables and the routing.
    two = sorted(probes(two_out), key=lambda p: p["rank"])
    assert [p["rank"] for p in two] == ["0", "1"] and all(p["world"] == "2" for p in two)
    assert all(p["routed"] and p["argv"] == ["--x", "1"] and p["main"] == "__main__" for p in two)
    # Control: the same script under plain python finds nothing installed, so the checks above can fail.
    (plain,) = probes(plain_out)
    assert plain["routed"] is False and plain["path0"] == str(tmp_path)


# ---------------------------------------------------------------------------------------------------
# TRL's DPOTrainer and GRPOTrainer, unchanged, through `megatrain launch` with a ZeRO-3-offload config


def _reports(tmp: Path, script: str, argv: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """The script's reports on MegaTrain through `megatrain launch` and on plain TRL (`python script --backend
    torch`). The two runs start side by side: neither reads what the other writes, and most of each is the
    single-threaded start-up of torch, transformers and TRL."""
    def args(name: str, *extra: str) -> list[str]:
        return [str(ROOT / "examples" / script), "--output_dir", str(tmp / name), "--report", str(tmp / f"{name}.json"),
                *extra, *argv]

    runs = [_start_launch(args("megatrain"), tmp),
            _start(args("plain", "--backend", "torch"), tmp)]
    for run in runs:
        _finish(run)
    return json.loads((tmp / "megatrain.json").read_text()), json.loads((tmp / "plain.json").read_text())


def _check_same_training(mt: dict, plain: dict, steps: int) -> None:
    assert mt["engine"] == "MegaTrainEngine" and plain["engine"] != "MegaTrainEngine"
    keys = [str(i) for i in range(1, steps + 1)]
    assert sorted(mt["losses"], key=int) == keys and sorted(plain["losses"], key=int) == keys
    assert max(abs(mt["losses"][s] - plain["losses"][s]) for s in keys) <= TOL, (mt, plain)
    norm_scale = max(1.0, max(plain["grad_norms"].values()))
    assert all(plain["grad_norms"][s] > 0.1 for s in keys), plain  # every step's update is non-trivial
    assert max(abs(mt["grad_norms"][s] - plain["grad_norms"][s]) for s in keys) <= TOL * norm_scale, (mt, plain)


@pytest.mark.slow
def test_dpo_trainer_through_megatrain_launch_matches_plain_trl(tmp_path):
    """examples/trl_dpo.py: ZeRO-3 offload config with a "megatrain" section, the reference log-probabilities
    precomputed by the policy's own engine (no second model store), no launcher variables."""
    mt, plain = _reports(tmp_path, "trl_dpo.py")
    _check_same_training(mt, plain, 3)
    # Control: consecutive losses move by far more than the tolerance, so misaligned steps could not pass.
    assert min(abs(plain["losses"][a] - plain["losses"][b]) for a, b in (("1", "2"), ("2", "3"))) > 10 * TOL


@pytest.mark.slow
def test_grpo_trainer_through_megatrain_launch_matches_plain_trl(tmp_path):
    """examples/trl_grpo.py at temperature 0.7 on a ZeRO-3 offload config: TRL used to stop in `remove_hooks`
    believing ZeRO-3 partitioned the model. Two steps keep it short."""
    mt, plain = _reports(tmp_path, "trl_grpo.py", ("--max_steps", "2"))
    assert mt["rewards"] == plain["rewards"]  # the same samples
    _check_same_training(mt, plain, 2)


# ---------------------------------------------------------------------------------------------------
# one engine per model: TRL's forward-only reference pass, then training, on the same store


def test_a_forward_only_engine_takes_over_the_trainers_optimizer_when_the_same_model_trains():
    import torch
    from conftest import tiny_model

    from megatrain.deepspeed.initializer import initialize as mt_initialize
    from megatrain.integrations.engine_reuse import initialize_once

    cfg = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": 3}, "megatrain": {}}
    model, ref = tiny_model(), tiny_model()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    forward_only, opt, _, _ = initialize_once(mt_initialize, None, (), {"model": model, "config": dict(cfg)})
    assert opt is None
    with torch.no_grad():
        before = forward_only(input_ids=ids, labels=ids).loss.item()
    assert before == pytest.approx(ref(input_ids=ids, labels=ids).loss.item(), abs=1e-5)
    stored = [p.data_ptr() for _, p in forward_only.engine.named_parameters()]
    # Trainer builds its optimizer over model.parameters() after the reference pass bound the model.
    trainer_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, opt, _, _ = initialize_once(mt_initialize, None, (), {"model": model, "optimizer": trainer_opt,
                                                                  "config_params": dict(cfg)})
    assert opt is trainer_opt and engine.engine is forward_only.engine  # the same store, no second engine
    assert [p.data_ptr() for _, p in engine.engine.named_parameters()] == stored
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    with torch.no_grad():
        assert engine(input_ids=ids, labels=ids).loss.item() < before - 1e-3  # the adopted optimizer trained it
    # Control: a model never put on a forward-only engine gets an engine of its own.
    other, _, _, _ = initialize_once(mt_initialize, None, (), {"model": ref, "config": dict(cfg)})
    assert other.engine is not forward_only.engine
