"""The speculative step with several data-parallel ranks (docs/DISTRIBUTED.md section 3): 2 gloo ranks under torchrun,
every layer streamed, accumulation 2, a clip that scales at some steps and not at others and one non-finite step
(skipped), each with speculative_step=True (waited for after each backward, so every speculation runs; not waited
for; with optimizer_overlap) against the same ranks' serial step, on the per-rank path (the node's
shared store, each layer's owner updating it whole; and each rank its own store, the ranks' average) and on the node
path's update by shard (each rank its ranges of every layer, rolled back by range); in FP32 compute and in the GPU's
defaults, bf16 compute with FP32 or hilo masters (the rollback then restores the bf16 shadow or the lo halves too:
a rollback that restored the FP32 master alone failed the bf16 and hilo cases, never the FP32 ones). Losses,
pre-clip norms, weights
and Adam state must be the serial step's bit for bit, with the same rollbacks and back-offs on every rank, and the
speculation must have run (layers kept) and been rolled back. The negative controls break the parity: a rank that
skips its rollback (both paths), and on the node path rollback copies of whole layers rather than of the rank's
ranges (a restore then writes over the other rank's ranges, before or after its update). One launch for the module
(worker: tests/workers/dp_speculative_worker.py).
"""

from __future__ import annotations

import json
import math
import subprocess

import pytest
import torch
from kit import ROOT, finish, start_python, worker_env

WORKER = ROOT / "tests" / "workers" / "dp_speculative_worker.py"
DEADLINE_S = 600  # a bound on a hang, not a speed target: the whole suite shares two cores
ARGS = {"micro": 2, "steps": 5, "layers": 4}
PATHS = ("per_rank", "replicated", "node")
# "": FP32 compute; "bf16": the GPU's default compute dtype (FP32 masters); "hilo": bf16 compute, the exact split master
PRECISIONS = ("", "bf16", "hilo")


def run(path: str, mode: str, *rest: str) -> str:
    """A run's name in the worker's "PATH:MODE[:VARIANT][:PRECISION]"."""
    return ":".join([path, mode, *(r for r in rest if r)])


RUNS = [run(p, m, pr) for pr in PRECISIONS for p in PATHS for m in ("serial", "spec")] + [
    "per_rank:auto", "node:spec:wholecopy"] + [run(p, "spec", "norollback", pr) for p in ("per_rank", "node")
                                               for pr in ("", "bf16")] + [
    f"{p}:spec:{v}" for p in PATHS for v in ("race", "overlap")] + ["per_rank:spec:slow", "per_rank:spec:slow_unmet"]
CLIPS = [1e9, 0.05, 1e9, 0.05, 1e9]  # the worker's: a clip that scales at steps 1 and 3
NAN_STEP = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("dp_speculative")
    log = out / "torchrun.log"
    with open(log, "w") as f:
        proc = start_python(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", WORKER, out,
                             json.dumps({**ARGS, "runs": RUNS})], env=worker_env(threads=1, PYTHONWARNINGS="ignore"),
                            stdout=f, stderr=subprocess.STDOUT, text=True)
    finish(proc, timeout=DEADLINE_S, log=log)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def _bits(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).view(torch.int64)  # NaN's bits too


def _differences(a: dict, b: dict) -> list[str]:
    """What differs, bit for bit, between two runs of one rank: losses, norms, each weight, each Adam state entry."""
    out = [k for k in ("losses", "norms") if not torch.equal(_bits(a[k]), _bits(b[k]))]
    out += [k for k in a["state"] if not torch.equal(a["state"][k], b["state"][k])]
    assert a["adam"].keys() == b["adam"].keys()
    out += [f"adam {k}.{n}" for k in a["adam"] for n in a["adam"][k]
            if not torch.equal(torch.as_tensor(a["adam"][k][n]), torch.as_tensor(b["adam"][k][n]))]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("path", PATHS)
def test_speculative_step_with_two_ranks_is_the_serial_step_bit_for_bit(ranks, path, precision):
    """In FP32 compute and in the GPU's defaults (bf16 compute; FP32 or hilo masters): the same rollback and NaN
    schedule, the serial step's bits."""
    serial = [r[run(path, "serial", precision)] for r in ranks]
    spec = [r[run(path, "spec", precision)] for r in ranks]
    assert (path == "node") == spec[0]["data_path"].startswith("node"), spec[0]["data_path"]
    assert all(s["compute_dtype"] == ("float32" if precision == "" else "bfloat16") for s in serial + spec)
    assert all(s["host_master"] == ("hilo" if precision == "hilo" else "fp32") for s in serial + spec)
    norms = serial[0]["norms"]
    # the clip scales where it is set low and at no other step; the poisoned step's norm is NaN (skipped)
    assert [n > c for n, c in zip(norms, CLIPS)] == [False, True, False, True, False]
    assert math.isnan(norms[NAN_STEP]) and all(r["skipped"] == 1 for r in spec)
    for r in range(2):
        assert _differences(serial[r], spec[r]) == [], (path, precision, r)
    # every rank reached the same verdicts: the same rollbacks, more than none; held steps kept speculated layers
    assert spec[0]["rollbacks"] == spec[1]["rollbacks"] > 0
    assert all(s["kept"] > 0 and s["layers"] == ARGS["layers"] for s in spec)
    assert all(s["rollbacks"] == 0 for s in serial)
    # the two clipped steps and the first step's first micro-batch (a forward before its step) roll back; the
    # non-finite step's layers never speculate (their gradients are checked first)
    assert spec[0]["rollbacks"] == 3


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["race", "overlap"])
@pytest.mark.parametrize("path", PATHS)
def test_racing_or_overlapped_speculation_is_the_serial_step_too(ranks, path, variant):
    """"race": no wait for the speculative jobs (a step overtakes some, which it then updates itself); "overlap":
    optimizer_overlap, each layer's next load behind its update (on the shared store, behind its owner's token)."""
    for r in range(2):
        assert _differences(ranks[r][f"{path}:serial"], ranks[r][f"{path}:spec:{variant}"]) == [], (path, variant, r)


@pytest.mark.slow
def test_auto_backs_off_alike_on_every_rank(ranks):
    auto = [r["per_rank:auto"] for r in ranks]
    for r in range(2):
        assert _differences(ranks[r]["per_rank:serial"], auto[r]) == []
    # steps 1-3 lose in a row: a pause from step 4 on, on both ranks
    assert [a["backoffs"] for a in auto] == [1, 1] and [a["quiet"] for a in auto] == [1, 1]


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["", "bf16"])
@pytest.mark.parametrize("path", ["per_rank", "node"])
def test_a_rank_skipping_its_rollback_breaks_the_parity(ranks, path, precision):
    """The negative control: rank 1 never restores its rolled-back layers (on the node path: its ranges); in bf16
    compute too, where the rollback also has the bf16 shadow the layers stream from to undo."""
    for r in range(2):
        diff = _differences(ranks[r][run(path, "serial", precision)], ranks[r][run(path, "spec", "norollback",
                                                                                      precision)])
        assert "losses" in diff and len(diff) > 10, (path, precision, r, diff)


@pytest.mark.slow
def test_node_path_rollback_copies_of_whole_layers_break_the_parity(ranks):
    """The negative control of the copy by range: each rank copying and restoring whole layers of the node's shared
    master and moments writes the other rank's ranges as it found them when it copied."""
    for r in range(2):
        assert _differences(ranks[r]["node:serial"], ranks[r]["node:spec:wholecopy"]) != [], r


@pytest.mark.slow
def test_a_discard_on_the_shared_store_waits_for_every_ranks_restores(ranks):
    """Rank 0's restores start late (the first step's forward before its step undoes its first backward's
    speculation): the other rank's forward loads rank 0's layers only once they are restored, as the serial step
    has them; the control, a discard that does not meet the other ranks, lets it load them as speculated."""
    for r in range(2):
        assert _differences(ranks[r]["per_rank:serial"], ranks[r]["per_rank:spec:slow"]) == [], r
        assert "losses" in _differences(ranks[r]["per_rank:serial"], ranks[r]["per_rank:spec:slow_unmet"]), r
