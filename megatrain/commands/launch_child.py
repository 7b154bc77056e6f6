"""`python -m megatrain.commands.launch_child SCRIPT ARGS...` (or `-m MODULE ARGS...`, or `--entry-point MODULE:ATTR NAME
ARGS...` for a console command): one process of `megatrain launch`.

It installs MegaTrain's DeepSpeed routing (`megatrain.integrations.hf`) and then runs the user's script exactly as
`python SCRIPT ARGS...` would: as `__main__`, with `sys.argv` set and the script's folder first on `sys.path`
(so its sibling modules import). Installing first, in the same interpreter, is what makes an unchanged script
train on MegaTrain: every `deepspeed.initialize` it reaches (its own, or through Trainer, accelerate or TRL) trains on
MegaTrain, its config built in code or read from a file, with a "megatrain" section or without
(`MEGATRAIN_LAUNCHED=1`, set here and inherited by the processes the script starts).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import runpy
import shutil
import sys
from collections.abc import Sequence

from ..files import env  # imports os alone: this module stays import-light

USAGE = ("usage: python -m megatrain.commands.launch_child (SCRIPT | -m MODULE | --entry-point MODULE:ATTR NAME) "
         "[ARGS...]")
ENTRY_POINT = "--entry-point"  # launch_command.ENTRY_POINT (not imported: this module stays import-light)
LAUNCHED_ENV = env.LAUNCHED  # every DeepSpeed config trains on MegaTrain


def install_routing() -> None:
    """Route every DeepSpeed config this process (and the processes it starts) reaches to MegaTrain, "megatrain"
    section or not; with MEGATRAIN_DEEPSPEED_GUARD=0 leave DeepSpeed as it is, saying so at its initialize. Without
    the deepspeed package nothing can reach DeepSpeed, so there is nothing to route (megatrain's own APIs need no
    routing). Called once `sys.path` is the script's: a `deepspeed` shim package beside it is the one found."""
    os.environ[LAUNCHED_ENV] = "1"
    if importlib.util.find_spec("deepspeed") is None:
        return
    if env.deepspeed_left_alone():
        import megatrain.integrations.on_deepspeed  # noqa: F401  says "DeepSpeed is training" at initialize
    else:
        import megatrain.integrations.hf  # noqa: F401  installs the routing on import


def run(argv: Sequence[str]) -> None:
    """Run `argv` (`[SCRIPT, *ARGS]`, `["-m", MODULE, *ARGS]` or `["--entry-point", "MODULE:ATTR", NAME,
    *ARGS]`) as `python` (or the console command NAME) would, routing installed first."""
    argv = list(argv)
    if not argv or (argv[0] == "-m" and len(argv) < 2) or (argv[0] == ENTRY_POINT and len(argv) < 3):
        raise SystemExit(USAGE)
    if argv[0] in (ENTRY_POINT, "-m"):
        sys.path[0:1] = [os.getcwd()]  # as `python -m` (and a console command's relative paths)
    else:
        if not os.path.isfile(argv[0]):
            raise SystemExit(f"megatrain launch: no such script: {argv[0]}")
        # `python script.py` puts the script's folder first on sys.path; `python -m megatrain.commands.launch_child`
        # put the working directory there instead.
        sys.path[0:1] = [os.path.dirname(os.path.realpath(argv[0]))]
    install_routing()
    if env.launch_gloo_group():
        gloo_group_where_nccl_cannot_run()
    if argv[0] == ENTRY_POINT:
        run_entry_point(argv[1], argv[2], argv[3:])
        return
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's file path in argv[0], as `python -m` does
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    sys.argv = [argv[0], *argv[1:]]
    runpy.run_path(argv[0], run_name="__main__")


def gloo_group_where_nccl_cannot_run() -> None:
    """The process group from torchrun's variables, on gloo, where NCCL cannot run (no CUDA device or no NCCL
    build): a tool that asks DeepSpeed's init_distributed for NCCL whatever the machine (axolotl) then finds a
    group and adopts it. Where NCCL can run nothing is made and the tool's own NCCL group is used."""
    import torch
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        return
    if torch.cuda.is_available() and dist.is_nccl_available():
        return
    dist.init_process_group("gloo", init_method="env://")


def run_entry_point(value: str, name: str, args: Sequence[str]) -> None:
    """What a console command's PATH wrapper does: `sys.exit(MODULE.ATTR())` with `sys.argv = [NAME, *args]`."""
    module, _, attr = value.partition(":")
    sys.argv = [shutil.which(name) or name, *args]
    obj = importlib.import_module(module)
    for part in filter(None, attr.split(".")):
        obj = getattr(obj, part)
    raise SystemExit(obj())


if __name__ == "__main__":
    run(sys.argv[1:])
