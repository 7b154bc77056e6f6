"""`megatrain plan` as the existing planner tests read it: the whole plan (`--details`), whose tables they check.
The first screen alone is tested by tests/unit/test_planner_node_path.py with the command's own main."""

from __future__ import annotations

from megatrain.commands.plan import main as plan_main


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    if argv and argv[0] in ("bench", "--list-hardware", "list-hardware"):
        return plan_main(argv)
    return plan_main([*argv, "--details"])
