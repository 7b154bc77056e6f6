"""`megatrain plan` as the existing planner tests read it: the whole plan (`--details`), whose tables they check.
The first screen alone is tested by tests/unit/test_planner_node_path.py with `python -m megatrain.planner`'s main."""

from __future__ import annotations

from megatrain.commands.cli import main as megatrain
from megatrain.planner.cli import main as planner  # `python -m megatrain.planner`: its --list-hardware


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    if argv and argv[0] in ("--list-hardware", "list-hardware"):
        return planner(argv)
    if argv and argv[0] == "bench":
        return megatrain(argv)
    if argv and argv[0] == "plan":
        argv = argv[1:]
    return megatrain(["plan", *argv, "--details"])
