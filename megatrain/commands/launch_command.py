"""What `megatrain launch NAME ARGS...` runs when NAME is not a script file: a console command (`trl`,
`llamafactory-cli`, ...), found as the `console_scripts` entry point of a package installed in this Python, the
same function its PATH wrapper calls (`sys.exit(main())`), so it runs in the process that holds MegaTrain's
routing.

Some tools start their own launcher for training, which would leave the routing behind; for those the command is
rewritten to what their launcher would run in each rank (`TOOL_RULES`):

- LlamaFactory (`llamafactory-cli train CFG` / `lmf train CFG`): its launcher re-runs `llamafactory/launcher.py
  CFG` under `torchrun` when FORCE_TORCHRUN=1 or more than one device is visible, and its argument parser refuses a
  DeepSpeed config outside torchrun ("Please use `FORCE_TORCHRUN=1` to launch DeepSpeed training": it checks
  TrainingArguments' parallel_mode, which is DISTRIBUTED only with torchrun's LOCAL_RANK set). `megatrain launch`
  takes its launcher's place: each rank runs `llamafactory.launcher` (LlamaFactory's torchrun target, its
  `run_exp()`) with torchrun's variables, a one-rank set when no launcher options are given.
- axolotl (`axolotl train CFG`): its CLI re-runs `-m axolotl.cli.train CFG` under `accelerate launch` (or
  torchrun), and with a DeepSpeed config its `setup_deepspeed_env` calls `deepspeed.comm.init_distributed(
  dist_backend="nccl")`, which cannot start where NCCL cannot run (no CUDA). Each rank runs `axolotl.cli.train CFG`
  with torchrun's variables; where NCCL cannot run, the bootstrap first makes a gloo process group from them
  (GLOO_GROUP_ENV), which DeepSpeed's init_distributed then adopts instead of creating an NCCL one.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata

ENTRY_POINT = "--entry-point"  # launch_child's form: [ENTRY_POINT, "module:attr", NAME, *ARGS]
GLOO_GROUP_ENV = "MEGATRAIN_LAUNCH_GLOO_GROUP"  # "1": the bootstrap makes a gloo group where NCCL cannot run


@dataclass(frozen=True)
class Command:
    """A console command resolved for the bootstrap."""

    child: list[str]  # launch_child's argv
    rank_env: bool = False  # the tool refuses to train unless it sees a launcher's (torchrun's) variables
    gloo_group: bool = False  # the tool asks for NCCL whatever the machine: a gloo group first where NCCL cannot run
    said: str | None = None  # what `megatrain launch` does in the tool's launcher's place, said at start


class CommandError(ValueError):
    """NAME is neither a script nor a console command this Python can run."""


def entry_point(name: str) -> metadata.EntryPoint | None:
    """The `console_scripts` entry point `name` of a package installed in this Python, or None."""
    found = metadata.entry_points(group="console_scripts", name=name)
    return next(iter(found), None)


def _llamafactory_train(args: list[str]) -> Command | None:
    if not args or args[0] != "train" or os.environ.get("USE_V1", "0").lower() in ("1", "true", "y"):
        return None
    for var in ("NPROC_PER_NODE", "NNODES"):
        if os.environ.get(var, "1") != "1":
            raise CommandError(f"{var}={os.environ[var]} is read by LlamaFactory's own launcher, which "
                               "`megatrain launch` replaces (it would start the ranks without MegaTrain): give "
                               f"`megatrain launch --{var.lower().replace('_', '-')} {os.environ[var]} "
                               "llamafactory-cli train ...` instead")
    return Command(["-m", "llamafactory.launcher", *args[1:]], rank_env=True,
                   said="megatrain launch: LlamaFactory's `train` runs in each rank as its torchrun launch would "
                        "(llamafactory.launcher), with MegaTrain's routing")


def _axolotl_train(args: list[str]) -> Command | None:
    if not args or args[0] != "train":
        return None
    theirs = [a for a in args[1:] if a == "--" or a.split("=", 1)[0] in ("--launcher", "--cloud")]
    if theirs:
        raise CommandError(f"{theirs[0]} picks axolotl's own launcher, which `megatrain launch` replaces (it would "
                           "start the ranks without MegaTrain): drop it and give torchrun's options to megatrain "
                           "launch instead (`megatrain launch --nproc-per-node N axolotl train cfg.yml`)")
    return Command(["-m", "axolotl.cli.train", *args[1:]], rank_env=True, gloo_group=True,
                   said="megatrain launch: axolotl's `train` runs in each rank as its launcher would "
                        "(axolotl.cli.train), with MegaTrain's routing")


# entry point value -> rewrite(ARGS) for tools whose training command starts a launcher of its own
TOOL_RULES = {"llamafactory.cli:main": _llamafactory_train, "axolotl.cli.main:main": _axolotl_train}


def resolve(name: str, args: Sequence[str]) -> Command:
    """The bootstrap's argv for console command `name` with `args`. Raises CommandError naming the fix."""
    ep = entry_point(name)
    if ep is None:
        on_path = shutil.which(name)
        where = (f"`{on_path}` is on PATH but belongs to another Python environment; install its package into "
                 f"this one ({sys.executable})" if on_path else
                 "not a console command of any package installed in this Python "
                 f"({sys.executable}); give a script path, `-m MODULE`, or install the tool here")
        raise CommandError(f"no such script or console command: {name} ({where})")
    rule = TOOL_RULES.get(ep.value)
    command = rule(list(args)) if rule is not None else None
    return command or Command([ENTRY_POINT, ep.value, name, *args])


def one_rank_env(environ: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """torchrun's variables for a single rank (`--nproc-per-node 1`), with a free port for its store; variables
    already set are kept."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    want = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    return {k: v for k, v in want.items() if k not in environ}
