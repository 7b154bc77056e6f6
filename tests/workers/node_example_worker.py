"""Another data-parallel worker (dp_worker.py, dp_resume_worker.py) with examples/train_data_parallel.py on the node
path: the example's engine section gains data_parallel_path="node" and every layer streamed (a resident layer is
not gathered), so the same faults, saves and resumes run through the node path's gathers and reduce-scatters.

Run as `python tests/workers/node_example_worker.py WORKER OUT_DIR JSON_ARGS` with torchrun's variables: WORKER runs
as its own `__main__` with OUT_DIR JSON_ARGS. Each engine's data path (`DataPath.describe()`) is appended to
OUT_DIR/rank{r}_paths.txt as it is chosen, for the test to check that the node path ran.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path
from typing import Any

import examples_module

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


def main() -> None:
    worker = sys.argv.pop(1)
    on_node_path()
    record_paths(Path(sys.argv[1]))
    sys.argv[0] = worker
    runpy.run_path(worker, run_name="__main__")


if __name__ == "__main__":
    main()
