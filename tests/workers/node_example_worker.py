"""Another data-parallel worker (dp_worker.py, dp_resume_worker.py) with examples/train_data_parallel.py on the node
path: the example's engine section gains data_parallel_path="node" and every layer streamed (a resident layer is
not gathered), so the same faults, saves and resumes run through the node path's gathers and reduce-scatters.

Run as `python tests/workers/node_example_worker.py WORKER OUT_DIR JSON_ARGS` with torchrun's variables: WORKER runs
as its own `__main__` with OUT_DIR JSON_ARGS. Each engine's data path (`DataPath.describe()`) is appended to
OUT_DIR/rank{r}_paths.txt as it is chosen, for the test to check that the node path ran. JSON_ARGS' "die_at_forward":
n (read here only): rank 1 writes OUT_DIR/fault_time and exits with status 17 as its n-th forward starts.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any

import examples_module

DIED = 17

NODE_SETTINGS = {"data_parallel_path": "node", "residency": "stream"}


def on_node_path() -> None:
    load = examples_module.load_example

    def load_on_node_path(name: str) -> Any:
        module = load(name)
        section = module.engine_section
        module.engine_section = lambda watchdog_s: {**section(watchdog_s), **NODE_SETTINGS}
        return module

    # The workers import load_example from this module when they start, after this.
    examples_module.load_example = load_on_node_path


def record_paths(out: Path) -> None:
    from megatrain.engine.parallel import node_path

    attach = node_path.attach

    def recorded(*args: Any, **kwargs: Any) -> Any:
        path = attach(*args, **kwargs)
        with open(out / f"rank{os.environ.get('RANK', '0')}_paths.txt", "a") as f:
            f.write(path.describe() + "\n")
        return path

    node_path.attach = recorded


def die_at_forward(n: int, out: Path) -> None:
    from megatrain.engine.engine import Engine

    forward = Engine.forward
    calls = [0]

    def dying(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == n:
            (out / "fault_time").write_text(repr(time.time()))
            os._exit(DIED)
        return forward(self, *args, **kwargs)

    Engine.forward = dying


def main() -> None:
    worker = sys.argv.pop(1)
    on_node_path()
    out = Path(sys.argv[1])
    record_paths(out)
    at = json.loads(sys.argv[2]).get("die_at_forward")
    if at is not None and os.environ.get("RANK") == "1":
        die_at_forward(int(at), out)
    sys.argv[0] = worker
    runpy.run_path(worker, run_name="__main__")


if __name__ == "__main__":
    main()
