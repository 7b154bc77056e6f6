"""`python -m megatrain.launch_child SCRIPT ARGS...` (or `-m MODULE ARGS...`): one process of `megatrain launch`.

It installs MegaTrain's DeepSpeed routing (`megatrain.integrations.hf`) and then runs the user's script exactly as
`python SCRIPT ARGS...` would: as `__main__`, with `sys.argv` set and the script's folder first on `sys.path`
(so its sibling modules import). Installing first, in the same interpreter, is what makes an unchanged script
train on MegaTrain: every `deepspeed.initialize` it reaches (through Trainer, accelerate or TRL) is routed by
its config.
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys
from collections.abc import Sequence

USAGE = "usage: python -m megatrain.launch_child (SCRIPT | -m MODULE) [ARGS...]"


def install_routing() -> None:
    """Route DeepSpeed configs with a "megatrain" section to MegaTrain in this process. Without the deepspeed
    package nothing can reach DeepSpeed, so there is nothing to route (megatrain's own APIs need no routing)."""
    if importlib.util.find_spec("deepspeed") is not None:
        import megatrain.integrations.hf  # noqa: F401  installs the routing on import


def run(argv: Sequence[str]) -> None:
    """Run `argv` (`[SCRIPT, *ARGS]` or `["-m", MODULE, *ARGS]`) as `python` would, routing installed first."""
    argv = list(argv)
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        raise SystemExit(USAGE)
    install_routing()
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's file path in argv[0], as `python -m` does
        sys.path[0:1] = [os.getcwd()]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    script = argv[0]
    if not os.path.isfile(script):
        raise SystemExit(f"megatrain launch: no such script: {script}")
    sys.argv = [script, *argv[1:]]
    # `python script.py` puts the script's folder first on sys.path; `python -m megatrain.launch_child` put the
    # working directory there instead.
    sys.path[0:1] = [os.path.dirname(os.path.realpath(script))]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    run(sys.argv[1:])
