"""A checkpoint saved by 2 ranks on the node path (docs/DISTRIBUTED.md) resumes bit-identically on 2 ranks, through
both faces: the DeepSpeed face's save_checkpoint / load_checkpoint and the accelerator face's save_state /
load_state (examples/train_data_parallel.py, driven by tests/workers/dp_resume_worker.py with every layer streamed
and data_parallel_path="node": tests/workers/node_example_worker.py).

Two launches of 2 gloo ranks. The first trains the whole run uninterrupted (TOTAL_STEPS), then afresh for
SAVED_STEPS and saves; the second, a fresh launch, resumes that checkpoint up to TOTAL_STEPS. The resumed run's
per-micro-batch losses and per-step norms are the uninterrupted run's last ones exactly, and its final weights
equal the uninterrupted run's bit for bit on every rank: the node path's gathers and reduce-scatters start from
the checkpoint's masters, Adam moments, LR schedule and data position with nothing lost or rounded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from kit import ROOT, bits
from test_data_parallel import Ranks

WORKER = ROOT / "tests" / "workers" / "dp_resume_worker.py"
NODE_WORKER = ROOT / "tests" / "workers" / "node_example_worker.py"
MICRO, WORLD = 3, 2  # rows per rank per micro-batch: a global micro-batch of 6
SAVED_STEPS, TOTAL_STEPS, ACCUMULATION = 3, 5, 2  # ACCUMULATION: the worker's (dp_resume_worker passes 2)
FACES = ("deepspeed", "accelerator")
CLIP = 0.05  # the example's


def _launch(phases: list[dict[str, Any]], tmp: Path) -> list[dict[str, Any]]:
    """One bounded 2-rank launch of the resume worker on the node path: every rank's results."""
    tmp.mkdir(parents=True)
    args = {"micro": MICRO, "watchdog_s": 120.0, "delay_s": 0.5, "phases": phases}
    ranks = Ranks(WORLD, [str(NODE_WORKER), str(WORKER), str(tmp), json.dumps(args)], tmp)
    codes = ranks.wait()
    assert codes == [0] * WORLD, "\n".join(ranks.log(r)[-3000:] for r in range(WORLD))
    for r in range(WORLD):  # every engine of the launch ran the node path
        chosen = (tmp / f"rank{r}_paths.txt").read_text().splitlines()
        assert len(chosen) == len(phases) * len(FACES) and all(c.startswith("node:") for c in chosen), (r, chosen)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("node_resume")
    ckpt = tmp / "ckpt"
    first = _launch([{"key": "whole", "steps": TOTAL_STEPS},
                     {"key": "saved", "steps": SAVED_STEPS, "save_to": str(ckpt)}], tmp / "launch1")
    second = _launch([{"key": "resumed", "steps": TOTAL_STEPS, "resume_from": str(ckpt)}], tmp / "launch2")
    return {"first": first, "second": second}


@pytest.mark.slow
@pytest.mark.parametrize("face", FACES)
def test_a_node_path_checkpoint_of_two_ranks_resumes_bit_identically_on_two(runs: dict[str, Any], face: str) -> None:
    done = SAVED_STEPS * ACCUMULATION
    for r in range(WORLD):
        whole = runs["first"][r]["whole"][face]
        saved = runs["first"][r]["saved"][face]
        resumed = runs["second"][r]["resumed"][face]
        assert len(whole["norms"]) == TOTAL_STEPS and min(whole["norms"]) > 2 * CLIP, (face, r)  # clipping acts
        # The run that wrote the checkpoint was the uninterrupted run's first part, exactly.
        assert saved["losses"] == whole["losses"][:done] and saved["norms"] == whole["norms"][:SAVED_STEPS], (face, r)
        # The resumed run trained only the remaining micro-batches, each exactly as the uninterrupted run did.
        assert resumed["losses"] == whole["losses"][done:], (face, r, resumed["losses"], whole["losses"][done:])
        assert resumed["norms"] == whole["norms"][SAVED_STEPS:], (face, r, resumed["norms"], whole["norms"])
        assert resumed["state"].keys() == whole["state"].keys()
        differ = [k for k, v in whole["state"].items() if not torch.equal(bits(v), bits(resumed["state"][k]))]
        assert not differ, (face, r, differ)
        # The checkpoint's weights are not the end's: the resumed steps trained them on.
        assert any(not torch.equal(saved["state"][k], v) for k, v in whole["state"].items()), (face, r)
