"""`megatrain launch [LAUNCHER OPTIONS] SCRIPT ARGS...`: run an unchanged training script (or a console command:
`megatrain launch llamafactory-cli train cfg.yaml`, `megatrain launch trl sft ...`) on MegaTrain, the way
`deepspeed SCRIPT` and `accelerate launch SCRIPT` run theirs.

Every process runs `python -m megatrain.commands.launch_child SCRIPT ARGS...`, which installs MegaTrain's DeepSpeed
routing before the script's first line, so every DeepSpeed config the script reaches (Trainer, TRL, accelerate, its
own `deepspeed.initialize`; built in code or read from a file, with a "megatrain" section or without) trains on
MegaTrain; MEGATRAIN_DEEPSPEED_GUARD=0 leaves it on DeepSpeed, said on the run's start line. A NAME that is no file is looked
up as a console command (launch_command.py: its entry point, run in the same process; a tool whose training
command starts a launcher of its own is run as that launcher would run each rank).

- No launcher options: one process, this one, with no launcher variables, exactly as `python SCRIPT` (MegaTrain
  gives Trainer / accelerate the one-rank process group they expect); a tool that refuses to train outside a
  launcher (LlamaFactory's `train`) gets torchrun's one-rank variables.
- Launcher options (`--nproc-per-node N`, `--nnodes`, `--node-rank`, `--master-addr`, `--master-port`,
  `--standalone`, `--rdzv-*`, ...: torchrun's own, parsed by torch's parser): torch's elastic launcher starts the
  ranks with torchrun's environment variables, each rank through the same bootstrap module.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from ..files import env
from .launch_command import GLOO_GROUP_ENV, Command, CommandError, one_rank_env
from .launch_command import resolve as resolve_command

PROG = "megatrain launch"
_NAMED_COUNTS = ("auto", "cpu", "gpu", "xpu")


class LaunchError(ValueError):
    """A `megatrain launch` command line that cannot run (no script, a bad process count, ...)."""


def _torchrun_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = PROG

    def error(message: str) -> None:
        raise LaunchError(f"{message}; usage: {PROG} [--nproc-per-node N ...] (SCRIPT | COMMAND) [ARGS...] (--help lists the "
                          "launcher options)")

    parser.error = error  # type: ignore[method-assign]  # one line naming the problem, not torchrun's usage wall
    parser.description = ("Run SCRIPT (an unchanged training script) or COMMAND (a console command such as "
                          "`llamafactory-cli train cfg.yaml` or `trl sft ...`) with MegaTrain's DeepSpeed routing "
                          "installed in every process. Without launcher options: one process, as `python SCRIPT`. "
                          "With them (torchrun's options, below): torch's elastic launcher starts the ranks.")
    return parser


def _check_nproc(value: str) -> None:
    if value in _NAMED_COUNTS:
        return
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise LaunchError(f"--nproc-per-node must be a positive integer or one of {', '.join(_NAMED_COUNTS)} "
                          f"(got {value!r})")


def plan(argv: Sequence[str]) -> tuple[argparse.Namespace | None, list[str]]:
    """Split a `megatrain launch` command line: (torchrun's parsed options, or None for one plain process,
    [SCRIPT, *ARGS], ["-m", MODULE, *ARGS] or a console command's entry point for the bootstrap). Raises
    LaunchError on a line that cannot run."""
    args, command = _plan(argv)
    return args, command.child


def _plan(argv: Sequence[str]) -> tuple[argparse.Namespace | None, Command]:
    argv = list(argv)
    parser = _torchrun_parser()
    if not argv:
        raise LaunchError(f"no script given; usage: {PROG} [--nproc-per-node N ...] (SCRIPT | COMMAND) [ARGS...]")
    args = parser.parse_args(argv)
    if args.no_python or args.run_path:
        raise LaunchError("--no-python / --run-path would start the script without MegaTrain's routing; drop them")
    child = ["-m", args.training_script] if args.module else [args.training_script]
    child += args.training_script_args
    command = Command(child)
    if not args.module and not os.path.isfile(args.training_script):
        if os.sep in args.training_script or "/" in args.training_script:
            raise LaunchError(f"no such script: {args.training_script}")
        try:  # a console command (`trl`, `llamafactory-cli`): its entry point in this Python
            command = resolve_command(args.training_script, args.training_script_args)
        except CommandError as e:
            raise LaunchError(str(e)) from None
    if args.module:
        import importlib.util

        try:
            found = importlib.util.find_spec(args.training_script) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise LaunchError(f"no such module: {args.training_script}")
    _check_nproc(args.nproc_per_node)
    launcher_options = argv[: len(argv) - len(args.training_script_args) - 1]
    if launcher_options == ["-m"] or launcher_options == ["--module"] or not launcher_options:
        return None, command
    return args, command


def launch(argv: Sequence[str]) -> int:
    """Run the command line `argv` (what follows `megatrain launch`); the script's exit status comes back."""
    args, command = _plan(argv)
    child = command.child
    if command.said:
        print(command.said, file=sys.stderr)
    if command.gloo_group:  # read by launch_child in this process or in every rank
        os.environ[GLOO_GROUP_ENV] = "1"
    if args is None:
        from .launch_child import LAUNCHED_ENV, run

        if command.rank_env:  # the tool checks it runs under a launcher: torchrun's one-rank variables
            os.environ.update(one_rank_env(os.environ))
        was = env.value(env.LAUNCHED)
        try:
            run(child)
        except SystemExit as e:  # the script's own sys.exit(...)
            if e.code is None or isinstance(e.code, int):
                return int(e.code or 0)
            print(e.code, file=sys.stderr)
            return 1
        finally:  # this process may go on (a caller in Python): it is no longer under `megatrain launch`
            if was is None:
                os.environ.pop(LAUNCHED_ENV, None)
        return 0
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run as torchrun

    args.module = True
    args.training_script = "megatrain.commands.launch_child"
    args.training_script_args = child
    try:
        torchrun(args)
    except ChildFailedError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        failures = list(e.failures.values())
        return failures[0].exitcode if failures and failures[0].exitcode > 0 else 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return launch(sys.argv[1:] if argv is None else argv)
    except LaunchError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
