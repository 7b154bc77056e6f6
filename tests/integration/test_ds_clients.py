"""DeepSpeed's own clients, unchanged: a script in DeepSpeed's example style (tests/workers/ds_example: config dict in
code, the user's AdamW to `deepspeed.initialize`, `model.backward` / `model.step`, `get_accelerator().set_device`,
GatheredParameters around saving, `model.tput_timer`, `model.global_rank`, `deepspeed.comm.get_rank()`, helpers
that import deepspeed themselves) trains on MegaTrain three ways, each saying so on its start line, with DeepSpeed's
losses (stage 0, FP32, 20 steps), and its saved model reloads with transformers to the engine's logits:

- unchanged under `megatrain launch` (its config has no "megatrain" section: the command chooses MegaTrain);
- with `import megatrain as deepspeed` (and `megatrain.deepspeed` for the helpers' `from deepspeed... import`);
- with every deepspeed import redirected (a `deepspeed/__init__.py` shim holding `import megatrain.deepspeed.redirect`).

The reference is the same script on real DeepSpeed: under `megatrain launch` with MEGATRAIN_DEEPSPEED_GUARD=0 (the
opt-out, which must say DeepSpeed trains), and under plain torchrun for two ranks (which must say why DeepSpeed
trains: no section, no `megatrain launch`).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from kit import ROOT, TAIL_CHARS, free_port, start_python, worker_env

pytest.importorskip("deepspeed")

EXAMPLE = ROOT / "tests" / "workers" / "ds_example"
STEPS = 20
TOL = 1e-5
MT_LINE = "MegaTrain is training | face: DeepSpeed (megatrain.initialize)"
DS_LINE = "DeepSpeed is training | engine: DeepSpeedEngine (real DeepSpeed)"


def _env(world_size: str | None = None, **extra: str) -> dict[str, str]:
    from baselines.zero3 import default_extensions_dir

    env = worker_env(threads=1, drop=("MEGATRAIN_DEEPSPEED_GUARD", "MEGATRAIN_LAUNCHED"),
                     world_size=int(world_size) if world_size else None, **extra)
    env.setdefault("TORCH_EXTENSIONS_DIR", default_extensions_dir())
    return env


def _copy(tmp: Path, way: str) -> Path:
    """The example as run `way`: "unchanged", "as" (`import megatrain as deepspeed` in every file) or "redirect"
    (unchanged, a shim package beside it)."""
    where = tmp / way / "app"
    shutil.copytree(EXAMPLE, where, ignore=shutil.ignore_patterns("__pycache__"))
    if way == "as":
        for f in where.glob("*.py"):
            text = f.read_text()
            text = re.sub(r"^import deepspeed$", "import megatrain as deepspeed", text, flags=re.M)
            text = re.sub(r"^(from|import) deepspeed\.", r"\1 megatrain.deepspeed.", text, flags=re.M)
            f.write_text(text)
    if way == "redirect":
        (where / "deepspeed").mkdir()
        (where / "deepspeed" / "__init__.py").write_text("import megatrain.deepspeed.redirect  # noqa: F401\n")
    return where


def _start(tmp: Path, name: str, argv: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, Path, Path]:
    out = tmp / name / "out"
    out.mkdir(parents=True)
    log = tmp / name / "log.txt"
    with open(log, "w") as f:
        proc = start_python([*argv, "--out", out, "--save_dir", tmp / name / "saved", "--steps", str(STEPS)],
                            cwd=tmp / name, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)
    return proc, out, log


def _finish(run: tuple[subprocess.Popen, Path, Path], ranks: int = 1) -> tuple[list[dict], str]:
    proc, out, log = run
    try:
        proc.wait(timeout=900)
    finally:
        proc.kill()
    text = log.read_text()
    assert proc.returncode == 0, text[-TAIL_CHARS:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)], text


def _launch(*opts: str) -> list[str]:
    return ["-m", "megatrain.commands.cli", "launch", *opts]


def _assert_reloads_to_the_engines_logits(saved: Path, report: dict) -> None:
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(saved, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(report["probe"])).logits
    assert (logits - torch.tensor(report["logits"])).abs().max().item() <= TOL


def _assert_same_losses(mine: list[float], ref: list[float]) -> None:
    assert len(mine) == len(ref) == STEPS
    assert max(abs(a - b) for a, b in zip(mine, ref)) <= TOL
    assert abs(mine[0] - mine[-1]) > 10 * TOL  # control: the loss moves, so a run that does not train would show


@pytest.mark.slow
def test_a_deepspeed_example_script_trains_on_megatrain_three_ways_with_deepspeeds_losses(tmp_path):
    runs = {
        # one rank started as DeepSpeed needs it (its init_distributed reads a launcher's variables)
        "deepspeed": _start(tmp_path, "deepspeed", _launch("--nproc-per-node", "1", "--master-port", str(free_port()),
                                                           str(_copy(tmp_path, "deepspeed") / "main.py")),
                            _env(MEGATRAIN_DEEPSPEED_GUARD="0")),
        "launch": _start(tmp_path, "unchanged", _launch(str(_copy(tmp_path, "unchanged") / "main.py")), _env()),
        "as": _start(tmp_path, "as", [_copy(tmp_path, "as") / "main.py"], _env()),
        # the shim under `megatrain launch` (here) and under plain torchrun (two ranks, below)
        "redirect": _start(tmp_path, "redirect", _launch(str(_copy(tmp_path, "redirect") / "main.py")), _env()),
    }
    done = {name: _finish(run) for name, run in runs.items()}
    (ref,), ref_log = done.pop("deepspeed")
    # The opt-out trains on real DeepSpeed and says so, on the line MegaTrain's start line would take.
    assert ref["engine"] == "DeepSpeedEngine" and MT_LINE not in ref_log
    assert f"{DS_LINE} | left on DeepSpeed by MEGATRAIN_DEEPSPEED_GUARD=0" in ref_log
    for name, ((report,), log) in done.items():
        assert report["engine"] == "MegaTrainEngine", name
        (line,) = [ln for ln in log.splitlines() if "MegaTrain is training" in ln]
        assert MT_LINE in line and DS_LINE not in log, name
        assert (report["global_rank"], report["comm_rank"], report["world"], report["epochs"]) == (0, 0, 1, 1)
        _assert_same_losses(report["losses"], ref["losses"])
        _assert_reloads_to_the_engines_logits(tmp_path / ("unchanged" if name == "launch" else name) / "saved",
                                              report)
    assert "via deepspeed.initialize under megatrain launch" in done["launch"][1]
    assert "via deepspeed.initialize" not in done["redirect"][1]  # the shim's own initialize: nothing was routed
    # The redirected run never imported real DeepSpeed: its modules are megatrain's (the control for that way).
    assert "DeepSpeed deepspeed.ops" not in done["redirect"][1]


@pytest.mark.slow
def test_the_example_on_two_ranks_under_megatrain_launch_and_torchrun_has_deepspeeds_losses(tmp_path):
    def ranks(*launcher: str) -> list[str]:
        return [*launcher, "--nproc-per-node", "2", "--master-port", str(free_port())]

    torchrun = ("-m", "torch.distributed.run")
    runs = {
        "deepspeed": _start(tmp_path, "deepspeed", [*ranks(*torchrun), _copy(tmp_path, "deepspeed") / "main.py"],
                            _env()),
        "launch": _start(tmp_path, "unchanged", [*ranks(*_launch()), _copy(tmp_path, "unchanged") / "main.py"],
                         _env()),
        "redirect": _start(tmp_path, "redirect", [*ranks(*torchrun), _copy(tmp_path, "redirect") / "main.py"],
                           _env()),
    }
    done = {name: _finish(run, ranks=2) for name, run in runs.items()}
    refs, ref_log = done.pop("deepspeed")
    # Plain torchrun, no "megatrain" section: real DeepSpeed trains, and the start line says why.
    assert all(r["engine"] == "DeepSpeedEngine" for r in refs)
    assert f'{DS_LINE} | the config has no "megatrain" section' in ref_log
    for name, (reports, log) in done.items():
        assert [r["engine"] for r in reports] == ["MegaTrainEngine"] * 2, name
        assert MT_LINE in log and DS_LINE not in log, name
        assert [(r["global_rank"], r["comm_rank"], r["world"]) for r in reports] == [(0, 0, 2), (1, 1, 2)]
        for mine, ref in zip(reports, refs):
            _assert_same_losses(mine["losses"], ref["losses"])
        _assert_reloads_to_the_engines_logits(tmp_path / ("unchanged" if name == "launch" else name) / "saved",
                                              reports[0])


def test_the_shim_needs_no_variable_and_the_startup_hook_routes_nothing(tmp_path):
    """With the start-up hook installed (no MEGATRAIN_* variable), a shim package makes `deepspeed` MegaTrain's:
    the hook's routing finds no real DeepSpeed and says nothing; DeepSpeed's import paths answer MegaTrain's objects."""
    shim = tmp_path / "deepspeed"
    shim.mkdir()
    (shim / "__init__.py").write_text("import megatrain.deepspeed.redirect  # noqa: F401\n")
    code = ("import sys, deepspeed, megatrain.deepspeed as m; "
            "from deepspeed import get_accelerator; "
            "from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus, GatheredParameters; "
            "import deepspeed.zero as z; from deepspeed.compression.helper import recursive_setattr; "
            "import megatrain.integrations.hf as hf; "
            "print(deepspeed is m, z.GatheredParameters is GatheredParameters, get_accelerator().device_name(), "
            "hf.installed(), ZeroParamStatus.AVAILABLE.value, "
            "any(type(f).__name__ == '_RouteDeepSpeed' for f in sys.meta_path) or 'hook gone')")
    env = _env()
    assert not [k for k in env if k.startswith("MEGATRAIN_") and k != "MEGATRAIN_CACHE"]
    # The shim's process and the control's (without the shim the same name is real DeepSpeed, and importing it
    # installs the routing) side by side: each is mostly its start-up, and neither writes anything.
    control = "import deepspeed, megatrain.integrations.hf as hf; print(deepspeed.__name__, hf.installed())"
    procs = [start_python(["-c", c], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c, cwd in ((code, tmp_path), (control, ROOT))]
    try:
        (out, err), (control_out, control_err) = (proc.communicate(timeout=300) for proc in procs)
    finally:
        for proc in procs:
            proc.kill()
    assert procs[0].returncode == 0, err[-TAIL_CHARS:]
    assert out.split() == ["True", "True", "cpu", "False", "1", "hook", "gone"], out
    assert control_out.split()[-2:] == ["deepspeed", "True"], control_err[-TAIL_CHARS:]


@pytest.mark.slow
def test_a_stage3_config_active_at_from_pretrained_trains_exactly_on_megatrain(tmp_path):
    """Under `megatrain launch` transformers builds the model whole; with `import megatrain as deepspeed` real
    DeepSpeed's partitioner builds it and initialize gathers it once. Both train as plain PyTorch does."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    script = ROOT / "tests" / "workers" / "ds_stage3_main.py"
    as_script = tmp_path / "as_main.py"
    as_script.write_text(re.sub(r"^import deepspeed$", "import megatrain as deepspeed", script.read_text(), flags=re.M))
    runs = {"launch": (_launch(str(script), str(tmp_path / "model"), str(tmp_path / "launch.json")), _env()),
            "as": ([as_script, tmp_path / "model", tmp_path / "as.json"], _env(world_size="1"))}
    procs = {}
    for name, (argv, env) in runs.items():
        with open(tmp_path / f"{name}.log", "w") as f:
            procs[name] = start_python(argv, cwd=tmp_path, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)
    # Plain PyTorch on the same weights and batches, meanwhile.
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(5)
    ref = []
    for _ in range(6):
        ids = torch.randint(0, 256, (2, 16), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref.append(loss.item())
    for name, proc in procs.items():
        proc.wait(timeout=900)
        log = (tmp_path / f"{name}.log").read_text()
        assert proc.returncode == 0, log[-TAIL_CHARS:]
        report = json.loads((tmp_path / f"{name}.json").read_text())
        assert report["engine"] == "MegaTrainEngine" and MT_LINE in log, name
        assert max(abs(a - b) for a, b in zip(report["losses"], ref)) <= TOL, name
        # launch: transformers was told (no zero.Init); as: DeepSpeed partitioned it and initialize gathered it
        assert report["partitioned_at_build"] == (name == "as"), name
        assert ("parameters gathered whole once" in log) == (name == "as"), name


@pytest.mark.slow
def test_a_deepspeed_chat_reward_script_trains_on_megatrain_under_launch_with_deepspeeds_losses(tmp_path):
    """DeepSpeed-Chat's reward-model step (tests/workers/ds_reward: a RewardModel over a causal LM's base model and a
    `v_head`, the pairwise loss) unchanged under `megatrain launch`: MegaTrain trains it (its start line), with real
    DeepSpeed's losses (stage 0, FP32, clipping 1.0: the same script with the opt-out)."""
    def start(name: str, argv: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, Path, Path]:
        where = tmp_path / name
        shutil.copytree(ROOT / "tests" / "workers" / "ds_reward", where / "app")
        (where / "out").mkdir()
        log = where / "log.txt"
        with open(log, "w") as f:
            proc = start_python([*argv, str(where / "app" / "main.py"), "--out", where / "out"], cwd=where, env=env,
                                stdout=f, stderr=subprocess.STDOUT, text=True)
        return proc, where / "out", log

    ds = start("deepspeed", _launch("--nproc-per-node", "1", "--master-port", str(free_port())),
               _env(MEGATRAIN_DEEPSPEED_GUARD="0"))
    mt = start("megatrain", _launch(), _env())
    ((ref,), ref_log), ((mine,), log) = _finish(ds), _finish(mt)
    assert ref["engine"] == "DeepSpeedEngine" and DS_LINE in ref_log
    assert mine["engine"] == "MegaTrainEngine" and MT_LINE in log and DS_LINE not in log
    assert len(mine["losses"]) == len(ref["losses"]) == 12
    assert max(abs(a - b) for a, b in zip(mine["losses"], ref["losses"])) <= TOL
    assert min(mine["norms"][:5]) > 1.0  # the first steps clipped (DeepSpeed reports no norm at stage 0 in FP32)
    assert abs(ref["losses"][0] - ref["losses"][-1]) > 10 * TOL  # control: the loss moves
