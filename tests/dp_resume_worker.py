"""One rank of a checkpoint-across-world-sizes test run: examples/train_data_parallel.py in phases.

Run as `python tests/dp_resume_worker.py OUT_DIR JSON_ARGS` with torchrun's variables in the environment.
JSON_ARGS: micro (rows per rank per micro-batch), watchdog_s, and phases: a list of
  {"key": name, "steps": n, "resume_from": root or null, "save_to": root or null}
each trained through both faces by the example's `run`, its results stored under `key`.

Every save (the DeepSpeed face's `save_checkpoint`, the accelerator face's `save_state`) is called by every
rank. Rank 0 enters it `delay_s` late, so a rank that returned before the checkpoint was whole would see
it unfinished; right after its call returns, each rank records what the checkpoint folder holds (every
file's sha256, by relative path) under results["views"], for the test to compare with the final folder.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from examples_module import load_example


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` (hidden ones too: a leftover temporary is a difference) -> its sha256."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def watch_saves(rank: int, delay_s: float, views: list[dict[str, Any]]) -> None:
    from megatrain import Accelerator
    from megatrain.initialize import MegaTrainEngine

    def wrap(cls: type, name: str, face: str) -> None:
        original: Callable[..., Any] = getattr(cls, name)

        @functools.wraps(original)
        def watched(self: Any, folder: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
            if rank == 0:
                time.sleep(delay_s)  # the others arrive first: they must not return before the folder is whole
            out = original(self, folder, *args, **kwargs)
            views.append({"face": face, "folder": str(folder), "files": snapshot(Path(folder))})
            return out

        setattr(cls, name, watched)

    wrap(MegaTrainEngine, "save_checkpoint", "deepspeed")
    wrap(Accelerator, "save_state", "accelerator")


def _root(phase: dict[str, Any], key: str) -> Path | None:
    return None if phase.get(key) is None else Path(phase[key])


def main() -> None:
    out, args = Path(sys.argv[1]), json.loads(sys.argv[2])
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    example = load_example("train_data_parallel")
    views: list[dict[str, Any]] = []
    watch_saves(rank, float(args.get("delay_s", 1.0)), views)
    results: dict[str, Any] = {}
    for phase in args["phases"]:
        results[phase["key"]] = example.run(["deepspeed", "accelerator"], args["micro"], phase["steps"], 2,
                                            args["watchdog_s"], save_to=_root(phase, "save_to"),
                                            resume_from=_root(phase, "resume_from"))
    results["views"] = views
    torch.save(results, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
