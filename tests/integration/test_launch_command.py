"""`megatrain launch COMMAND ARGS...`: a console command (a package's `console_scripts` entry point, as `trl` and
`llamafactory-cli` are) runs with MegaTrain's routing installed, in this process or in every rank; LlamaFactory's
`train` runs as its own torchrun launch would run each rank, so its DeepSpeed check passes; axolotl's `train` runs
where NCCL cannot (a gloo group made first).

The packages here are stand-ins installed into a temporary folder (a dist-info with entry_points.txt, as pip
writes one): LlamaFactory and axolotl (tens of dependencies each) do not install within CI's budget, so their
launchers' behaviour is reproduced from llamafactory 0.9.5 (launcher.py, hparams/parser.py) and axolotl 0.19
(cli/utils/train.py, utils/trainer.py); the real packages were measured by hand (docs/INTEGRATIONS.md).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from kit import probes, start_python, worker_env

from megatrain.commands.launch import LaunchError, plan
from megatrain.commands.launch import main as launch_main

ROOT = Path(__file__).resolve().parents[2]
_LAUNCHER_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                  "GROUP_RANK", "TORCHELASTIC_RUN_ID", "NPROC_PER_NODE", "NNODES", "FORCE_TORCHRUN", "USE_V1",
                  "MEGATRAIN_LAUNCH_GLOO_GROUP")

_PROBE = """
def probe(where):
    import json, os, sys
    print("PROBE " + json.dumps({"where": where, "routed": "megatrain.integrations.hf" in sys.modules,
                                 "argv": sys.argv[1:], "rank": os.environ.get("RANK"),
                                 "world": os.environ.get("WORLD_SIZE"), "local": os.environ.get("LOCAL_RANK")}),
          flush=True)
"""

# What llamafactory 0.9.5 does: cli.main -> launcher.launch(), which pops the command and, for `train` without
# FORCE_TORCHRUN on at most one device, runs run_exp() in this process; run_exp's argument parser refuses a
# DeepSpeed config unless TrainingArguments.parallel_mode is DISTRIBUTED, i.e. torchrun's LOCAL_RANK is set.
# Its torchrun launch runs launcher.py as a script, whose __main__ is run_exp().
_LF_CLI = "def main():\n    from . import launcher\n    launcher.launch()\n"
_LF_LAUNCHER = _PROBE + """
import os, sys

def run_exp():
    cfg = open(sys.argv[1]).read()
    if "deepspeed" in cfg and int(os.environ.get("LOCAL_RANK", "-1")) == -1:
        raise ValueError("Please use `FORCE_TORCHRUN=1` to launch DeepSpeed training.")
    probe("run_exp")

def launch():
    command = sys.argv.pop(1) if len(sys.argv) > 1 else "help"
    if command == "train":
        run_exp()
    else:
        probe(command)

if __name__ == "__main__":
    run_exp()
"""
_TOOL = _PROBE + "def main():\n    probe('tool')\n    return 3\n"

# What axolotl 0.19 does: `axolotl train CFG` re-runs `-m axolotl.cli.train CFG` under accelerate, whose
# setup_deepspeed_env calls deepspeed.comm.init_distributed(dist_backend="nccl"): that adopts a process group that
# exists already and otherwise creates an NCCL one, which fails without a GPU.
_AX_MAIN = "def main():\n    raise SystemExit('axolotl would start its own launcher here')\n"
_AX_TRAIN = _PROBE + """
import os, sys
import torch
import torch.distributed as dist

if __name__ == "__main__":
    if "deepspeed" in open(sys.argv[1]).read():
        if dist.is_initialized():
            backend = dist.get_backend()
        elif torch.cuda.is_available() and dist.is_nccl_available():
            backend = "nccl (its own)"
        else:
            raise RuntimeError("ProcessGroupNCCL is only supported with GPUs, no GPUs found!")
        os.environ["BACKEND"] = backend
    probe("axolotl.cli.train " + os.environ.get("BACKEND", ""))
"""


def _install(site: Path, dist: str, scripts: dict[str, str], files: dict[str, str]) -> None:
    """A package as pip leaves it in site-packages: its modules and a dist-info naming its console scripts."""
    for rel, text in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    info = site / f"{dist}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[console_scripts]\n" + "".join(f"{k} = {v}\n" for k, v in scripts.items()))


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("site")
    _install(site, "faketool", {"fake-train": "faketool.cli:main"},
             {"faketool/__init__.py": "", "faketool/cli.py": _TOOL})
    _install(site, "llamafactory", {"llamafactory-cli": "llamafactory.cli:main", "lmf": "llamafactory.cli:main"},
             {"llamafactory/__init__.py": "", "llamafactory/cli.py": _LF_CLI, "llamafactory/launcher.py": _LF_LAUNCHER})
    _install(site, "axolotl", {"axolotl": "axolotl.cli.main:main"},
             {"axolotl/__init__.py": "", "axolotl/cli/__init__.py": "", "axolotl/cli/main.py": _AX_MAIN,
              "axolotl/cli/train.py": _AX_TRAIN})
    return site


def _env(site: Path, **extra: str) -> dict[str, str]:
    return worker_env(drop=_LAUNCHER_VARS, path=[site], threads=1, **extra)


def _runs(site: Path, cwd: Path, *commands: tuple[str, ...]) -> list[subprocess.CompletedProcess]:
    """Every command (python's arguments) run side by side: each only prints its probes, and most of each is
    the interpreter's single-threaded start-up."""
    procs = [start_python(args, cwd=cwd, env=_env(site), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for args in commands]
    try:
        outputs = [proc.communicate(timeout=300) for proc in procs]
        return [subprocess.CompletedProcess(proc.args, proc.returncode, *out) for proc, out in zip(procs, outputs)]
    finally:
        for proc in procs:
            proc.kill()


def test_a_console_command_runs_its_entry_point_with_the_routing(site, tmp_path):
    r, control = _runs(site, tmp_path, ("-m", "megatrain.commands.cli", "launch", "fake-train", "--x", "1"),
                       ("-c", "import sys; from faketool.cli import main; sys.exit(main())"))
    assert r.returncode == 3, r.stderr[-3000:]  # the entry point's return value is the exit status, as its wrapper's
    (one,) = probes(r.stdout)
    assert one == {"where": "tool", "routed": True, "argv": ["--x", "1"], "rank": None, "world": None, "local": None}
    # Control: the entry point called without megatrain launch finds no routing, so the check above can fail.
    assert control.returncode == 3 and probes(control.stdout)[0]["routed"] is False


@pytest.mark.slow
def test_llamafactory_train_passes_its_deepspeed_check_under_megatrain_launch(site, tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("deepspeed: ds.json\n")
    control, r, r_two = _runs(site, tmp_path, ("-c", "from llamafactory.cli import main; main()", "train", str(cfg)),
                              ("-m", "megatrain.commands.cli", "launch", "llamafactory-cli", "train", str(cfg)),
                              ("-m", "megatrain.commands.cli", "launch", "--nproc-per-node", "2", "llamafactory-cli", "train",
                               str(cfg)))
    # Control: LlamaFactory's own launcher in one process refuses DeepSpeed, as the real one does.
    assert control.returncode == 1 and "Please use `FORCE_TORCHRUN=1`" in control.stderr
    assert r.returncode == 0, r.stderr[-3000:]
    (one,) = probes(r.stdout)
    # run_exp ran in a one-rank torchrun environment, with the config as its first argument, routed
    assert one == {"where": "run_exp", "routed": True, "argv": [str(cfg)], "rank": "0", "world": "1", "local": "0"}
    two = sorted(probes(r_two.stdout), key=lambda p: p["rank"])
    assert r_two.returncode == 0 and [(p["rank"], p["world"], p["argv"]) for p in two] == [("0", "2", [str(cfg)]),
                                                                                           ("1", "2", [str(cfg)])]


@pytest.mark.slow
def test_axolotl_train_runs_where_nccl_cannot(site, tmp_path):
    import torch
    import torch.distributed as dist

    cfg = tmp_path / "cfg.yml"
    cfg.write_text("deepspeed: ds.json\n")
    control, r = _runs(site, tmp_path, ("-m", "axolotl.cli.train", str(cfg)),
                       ("-m", "megatrain.commands.cli", "launch", "axolotl", "train", str(cfg)))
    # Control: axolotl's training module on its own asks for NCCL, which cannot start without a GPU.
    gpu = torch.cuda.is_available() and dist.is_nccl_available()
    assert (control.returncode == 0) if gpu else ("ProcessGroupNCCL" in control.stderr)
    assert r.returncode == 0, r.stderr[-3000:]
    (one,) = probes(r.stdout)
    # a gloo group from torchrun's one-rank variables where NCCL cannot run; the tool's own NCCL where it can
    assert one == {"where": "axolotl.cli.train " + ("nccl (its own)" if gpu else "gloo"), "routed": True,
                   "argv": [str(cfg)], "rank": "0", "world": "1", "local": "0"}


def test_which_llamafactory_commands_are_rewritten(site, monkeypatch):
    from megatrain.commands.launch_command import ENTRY_POINT

    monkeypatch.syspath_prepend(str(site))
    for var in _LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    assert plan(["lmf", "train", "c.yaml"]) == (None, ["-m", "llamafactory.launcher", "c.yaml"])  # the alias too
    # other subcommands are the tool's own entry point, untouched
    assert plan(["llamafactory-cli", "version"]) == (None, [ENTRY_POINT, "llamafactory.cli:main", "llamafactory-cli",
                                                            "version"])
    monkeypatch.setenv("USE_V1", "1")  # LlamaFactory's v1 launcher: not rewritten (not measured)
    assert plan(["lmf", "train", "c.yaml"])[1][0] == ENTRY_POINT
    # axolotl: its own launcher's options are refused with megatrain launch's to give instead
    assert plan(["axolotl", "train", "c.yml", "--learning_rate=1e-3"]) == (None, ["-m", "axolotl.cli.train", "c.yml",
                                                                                "--learning_rate=1e-3"])
    for theirs in (["--launcher", "torchrun"], ["--launcher=python"], ["--", "--num_processes", "2"]):
        with pytest.raises(LaunchError, match="megatrain launch --nproc-per-node N axolotl train"):
            plan(["axolotl", "train", "c.yml", *theirs])
    assert plan(["axolotl", "preprocess", "c.yml"])[1][:2] == [ENTRY_POINT, "axolotl.cli.main:main"]


def test_llamafactorys_own_process_count_is_refused_with_the_launch_option_to_use(site, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("NPROC_PER_NODE", "2")
    assert launch_main(["llamafactory-cli", "train", "cfg.yaml"]) == 2
    err = capsys.readouterr().err
    assert "NPROC_PER_NODE=2" in err and "--nproc-per-node 2" in err
    monkeypatch.setenv("NPROC_PER_NODE", "1")  # Control: one process is what megatrain launch runs anyway
    assert plan(["llamafactory-cli", "train", "cfg.yaml"])[1][:2] == ["-m", "llamafactory.launcher"]


def test_a_name_that_is_no_script_and_no_command_is_refused_by_name(tmp_path, capsys, monkeypatch):
    assert launch_main(["no-such-tool-xyz", "train"]) == 2
    err = capsys.readouterr().err
    assert "no such script or console command: no-such-tool-xyz" in err and "install the tool" in err
    # a command on PATH from another environment: its package is not importable here
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "other-env-tool").write_text("#!/bin/sh\n")
    (bin_dir / "other-env-tool").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert launch_main(["other-env-tool"]) == 2
    assert "belongs to another Python environment" in capsys.readouterr().err
    assert launch_main([str(tmp_path / "missing.py")]) == 2  # a path stays a path
    assert "no such script: " in capsys.readouterr().err
    # Control: a script file of that name is still a script, found before any command.
    (tmp_path / "trl").write_text("print('a script')\n")
    monkeypatch.chdir(tmp_path)
    assert plan(["trl", "sft"]) == (None, ["trl", "sft"])
