"""A checkpoint saved by 2 ranks on the node path (docs/DISTRIBUTED.md) resumes bit-identically on 2 ranks, through
both faces: the DeepSpeed face's save_checkpoint / load_checkpoint and the accelerator face's save_state /
load_state (examples/train_data_parallel.py, driven by tests/workers/dp_resume_worker.py with every layer streamed
and data_parallel_path="node": tests/workers/node_example_worker.py).

Launches of 2 gloo ranks. The first trains the whole run uninterrupted (TOTAL_STEPS), then afresh for SAVED_STEPS
and saves; the second resumes that checkpoint, and rank 1 is killed in the middle of its first step (rank 0 must stop
with the error naming it within the watchdog time); the third, the same command, resumes it up to TOTAL_STEPS. Its
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
from node_example_worker import DIED
from test_data_parallel import Ranks

WORKER = ROOT / "tests" / "workers" / "dp_resume_worker.py"
NODE_WORKER = ROOT / "tests" / "workers" / "node_example_worker.py"
MICRO, WORLD = 3, 2  # rows per rank per micro-batch: a global micro-batch of 6
SAVED_STEPS, TOTAL_STEPS, ACCUMULATION = 3, 5, 2  # ACCUMULATION: the worker's (dp_resume_worker passes 2)
FACES = ("deepspeed", "accelerator")
CLIP = 0.05  # the example's
KILL_WATCHDOG_S = 4.0


def _start(phases: list[dict[str, Any]], tmp: Path, **extra: Any) -> Ranks:
    tmp.mkdir(parents=True)
    args = {"micro": MICRO, "watchdog_s": 120.0, "delay_s": 0.5, "phases": phases, **extra}
    return Ranks(WORLD, [str(NODE_WORKER), str(WORKER), str(tmp), json.dumps(args)], tmp)


def _launch(phases: list[dict[str, Any]], tmp: Path) -> list[dict[str, Any]]:
    """One bounded 2-rank launch of the resume worker on the node path: every rank's results."""
    ranks = _start(phases, tmp)
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
    resume = [{"key": "resumed", "steps": TOTAL_STEPS, "resume_from": str(ckpt)}]
    # The resume, with rank 1 killed as its second forward starts (mid-step: accumulation 2); then the same
    # command again, which must resume from the checkpoint as if nothing had happened.
    killed = _start(resume, tmp / "killed", watchdog_s=KILL_WATCHDOG_S, die_at_forward=2)
    try:
        codes = killed.wait()
    finally:
        killed.kill()
    second = _launch(resume, tmp / "launch2")
    return {"first": first, "second": second, "killed": {"codes": codes, "log": killed.log(0),
                                                         "stopped_s": killed.exit_time[0] - float(
                                                             (tmp / "killed" / "fault_time").read_text())}}


@pytest.mark.slow
def test_a_rank_killed_mid_step_stops_the_other_with_its_error_and_the_same_command_resumes(runs: dict[str, Any]):
    """Rank 1 dies in the middle of the resumed run's first step: rank 0 stops with the data-parallel error naming it
    within the watchdog time (plus slack for a loaded machine's interpreter exit), and the same launch afterwards
    resumes the checkpoint bit-identically (the test below reads that launch)."""
    killed = runs["killed"]
    assert killed["codes"][1] == DIED and killed["codes"][0] not in (0, None), killed["codes"]
    assert "data parallel rank 0 of 2" in killed["log"] and "A peer rank died, hung" in killed["log"], \
        killed["log"][-3000:]
    assert killed["stopped_s"] <= KILL_WATCHDOG_S + 10.0, killed["stopped_s"]


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
