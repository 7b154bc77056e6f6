"""One rank of a checkpoint-across-world-sizes test run: examples/train_data_parallel.py in phases.

Run as `python tests/workers/dp_resume_worker.py OUT_DIR JSON_ARGS` with torchrun's variables in the environment.
JSON_ARGS: micro (rows per rank per micro-batch), watchdog_s, and phases: a list of
  {"key": name, "steps": n, "resume_from": root or null, "save_to": root or null}
each trained through both faces by the example's `run`, its results stored under `key`; with
"automatic_naming": project_dir, also two steps of the accelerator face saving with `save_state()` under
accelerate's automatic checkpoint naming (total_limit=1), then `load_state()` of the newest, on every rank.

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
    from megatrain.deepspeed.deepspeed_engine import MegaTrainEngine

    def wrap(cls: type, name: str, face: str) -> None:
        original: Callable[..., Any] = getattr(cls, name)

        @functools.wraps(original)
        def watched(self: Any, *args: Any, **kwargs: Any) -> Any:
            if rank == 0:
                time.sleep(delay_s)  # the others arrive first: they must not return before the folder is whole
            out = original(self, *args, **kwargs)
            # save_state returns the folder it wrote (the only way to learn it under automatic naming).
            folder = out if face == "accelerator" else args[0]
            files = snapshot(Path(folder)) if folder else {}  # "" would be the working directory
            views.append({"face": face, "folder": str(folder), "files": files})
            return out

        setattr(cls, name, watched)

    wrap(MegaTrainEngine, "save_checkpoint", "deepspeed")
    wrap(Accelerator, "save_state", "accelerator")


def automatic_naming(example: Any, rank: int, world: int, micro: int, project_dir: Path,
                     watchdog_s: float) -> dict[str, Any]:
    """Two optimizer steps, each followed by `save_state()` with accelerate's automatic naming and
    total_limit=1 (the second save rotates the first folder out), then `load_state()` of the newest."""
    from accelerate.utils import ProjectConfiguration

    from megatrain import Accelerator
    from megatrain.config.schema import EngineConfig

    acc = Accelerator(config=EngineConfig(**example.engine_section(watchdog_s)),
                      project_config=ProjectConfiguration(project_dir=str(project_dir),
                                                          automatic_checkpoint_naming=True, total_limit=1))
    model = example.build_model(seed=rank)
    opt = torch.optim.AdamW(model.parameters(), lr=example.LR)
    model, opt = acc.prepare(model, opt)
    data = example.Rows(2 * micro * world)
    paths = []
    for step in range(2):
        rows = data.ids[(step * world + rank) * micro: (step * world + rank + 1) * micro]
        acc.backward(model(input_ids=rows, labels=rows).loss)
        opt.step()
        opt.zero_grad()
        paths.append(acc.save_state())
    saved = {k: v.detach().clone() for k, v in acc.get_state_dict(model).items()}
    acc.load_state()
    loaded = acc.get_state_dict(model)
    return {"paths": paths, "reloaded_equal": all(torch.equal(saved[k], loaded[k]) for k in saved)}


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
        if phase.get("automatic_naming"):
            results[phase["key"] + "_auto"] = automatic_naming(
                example, rank, int(os.environ["WORLD_SIZE"]), args["micro"], Path(phase["automatic_naming"]),
                args["watchdog_s"])
    results["views"] = views
    torch.save(results, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
