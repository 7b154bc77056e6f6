"""Data parallel with one host store per node and the optimizer in backward: a layer's gradients are checked by
its owner alone, so a non-finite average that only the owner sees must still fail the step on every rank, the
same way, leaving the ranks' resident parameters and Adam steps identical; the ordinary step skips on every
rank (one 2-rank run; with the agreement turned off, the negative control, the ranks part ways)."""

from __future__ import annotations

import pytest
import torch
from test_data_parallel import ROOT, Ranks

WORKER = ROOT / "tests" / "workers" / "dp_nonfinite_worker.py"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nonfinite")
    ranks = Ranks(2, [str(WORKER), str(tmp)], tmp)
    codes = ranks.wait()
    assert codes == [0, 0], ranks.log(0)[-3000:] + ranks.log(1)[-3000:]
    return [torch.load(tmp / f"nonfinite{r}.pt") for r in range(2)]


@pytest.mark.slow
def test_every_rank_fails_the_step_only_the_owner_saw_non_finite(results):
    a, b = (r["agreed"] for r in results)
    assert a["outcomes"][0] == b["outcomes"][0] == "stepped"
    assert a["outcomes"][1] == b["outcomes"][1], (a["outcomes"], b["outcomes"])
    assert a["outcomes"][1].startswith("FloatingPointError: non-finite gradient (layer 1)"), a["outcomes"]
    # Neither rank stepped its resident parameters after the failed layer: the same weights and Adam steps.
    assert a["adam_steps"] == b["adam_steps"] == [1.0] * len(a["adam_steps"])
    assert all(torch.equal(x, y) for x, y in zip(a["resident"], b["resident"], strict=True))
    # And both refuse to train on until a checkpoint is loaded, as one process does.
    assert a["next"] == b["next"] and "load a checkpoint" in a["next"], (a["next"], b["next"])


@pytest.mark.slow
def test_the_ordinary_step_skips_on_every_rank(results):
    """Without the optimizer in backward the verdict is the global norm's, summed over the node: every rank
    skips the poisoned step and keeps the first step's state."""
    a, b = (r["default_step"] for r in results)
    assert a["outcomes"] == b["outcomes"] == ["stepped", "skipped"]
    assert a["adam_steps"] == b["adam_steps"] == [1.0] * len(a["adam_steps"])
    assert all(torch.equal(x, y) for x, y in zip(a["resident"], b["resident"], strict=True))
    assert a["next"] == b["next"] == "done"


@pytest.mark.slow
def test_without_the_agreement_the_ranks_part_ways(results):
    """The negative control: only the owner fails the step; the other rank steps its resident parameters."""
    a, b = (r["control"] for r in results)
    assert b["outcomes"][1].startswith("FloatingPointError: non-finite gradient (layer 1)"), b["outcomes"]
    assert not a["outcomes"][1].startswith("FloatingPointError"), a["outcomes"]
    assert a["adam_steps"] != b["adam_steps"], (a["adam_steps"], b["adam_steps"])
    assert not all(torch.equal(x, y) for x, y in zip(a["resident"], b["resident"], strict=True))
