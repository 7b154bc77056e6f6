"""Data parallel on torch.distributed (gloo, CPU): N ranks with micro-batch b train exactly as one process
with micro-batch N*b, through both faces, with clipping, accumulation and an LR schedule; a dead or hung
rank stops the others with a clear error within the watchdog time.

Every multi-process run is a set of subprocesses with a deadline, so a hang fails the test.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch
from examples_module import load_example
from kit import finish, free_port, parity_gaps, start_python, worker_env

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_data_parallel.py"
WORKER = ROOT / "tests" / "workers" / "dp_worker.py"
NODE_WORKER = ROOT / "tests" / "workers" / "node_example_worker.py"  # runs WORKER on the node path
DEADLINE_S = 420  # a bound on a hang, not a speed target: the whole suite shares two cores
TOL = 1e-5  # the project's parity tolerances: per-step losses, parameters at lr <= 1e-3


def _example():
    return load_example("train_data_parallel")


def _env() -> dict[str, str]:
    return worker_env(threads=1, PYTHONWARNINGS="ignore", DS_ACCELERATOR="cpu")


class Ranks:
    """One subprocess per rank with torchrun's variables; `wait` kills them all at the deadline."""

    def __init__(self, world: int, args: list[str], tmp: Path, per_node: int | None = None) -> None:
        """`per_node`: ranks per node (default all on one); several nodes are told apart by torchrun's GROUP_RANK."""
        port = free_port()
        per_node = per_node or world
        self.logs = [tmp / f"rank{r}.log" for r in range(world)]
        self.procs = []
        for r in range(world):
            env = worker_env(world_size=world, rank=r, local_rank=r % per_node, port=port, threads=1,
                             PYTHONWARNINGS="ignore", DS_ACCELERATOR="cpu", GROUP_RANK=str(r // per_node),
                             LOCAL_WORLD_SIZE=str(per_node))
            self.procs.append(start_python(args, env=env, log=self.logs[r]))
        self.exit_time: dict[int, float] = {}

    def poll(self) -> None:
        for r, p in enumerate(self.procs):
            if r not in self.exit_time and p.poll() is not None:
                self.exit_time[r] = time.time()

    def wait(self, ranks: list[int] | None = None) -> list[int | None]:
        ranks = list(range(len(self.procs))) if ranks is None else ranks
        deadline = time.time() + DEADLINE_S
        while time.time() < deadline:
            self.poll()
            if all(r in self.exit_time for r in ranks):
                return [p.returncode for p in self.procs]
            time.sleep(0.1)
        self.kill()
        pytest.fail(f"ranks {ranks} still running after {DEADLINE_S}s:\n{self.log(0)[-3000:]}")

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def log(self, r: int) -> str:
        return self.logs[r].read_text()


def _references(world: int, micro: int, faces: list[str]) -> dict[str, dict]:
    """Each face's one-process run with micro-batch world * micro (every_sync's is the accelerator face's), each
    trained once."""
    example, runs = _example(), {}
    for face in faces:
        kind = "accelerator" if face == "every_sync" else face
        if kind not in runs:
            runs[kind] = example.train(kind, micro * world, 1, 0)
    return {face: runs["accelerator" if face == "every_sync" else face] for face in faces}


def _meanwhile(stop, work):
    """`work()` here while ranks run (the one-process references read nothing the ranks write); `stop()` ends
    the ranks if it fails."""
    try:
        return work()
    except BaseException:
        stop()
        raise


def _check_parity(results: list[dict], world: int, micro: int, faces: list[str],
                  refs: dict[str, dict] | None = None) -> None:
    example = _example()
    refs = refs or _references(world, micro, faces)
    for face in faces:
        ref = refs[face]
        assert len(ref["norms"]) == 3 and min(ref["norms"]) > 2 * example.CLIP  # clipping really acts
        gaps = parity_gaps(ref, results[0][face])
        assert gaps["losses"] <= TOL and gaps["norms"] <= TOL and gaps["params"] <= TOL, (face, world, gaps)
        for r in range(1, world):  # every rank ends with the very same weights
            other = results[r][face]["state"]
            assert all(torch.equal(results[0][face]["state"][k], other[k]) for k in other), (face, r)


@pytest.mark.slow
def test_torchrun_two_ranks_match_one_process(tmp_path):
    """The example under torchrun: 2 ranks x micro-batch 2 == 1 process x micro-batch 4, both faces; the
    checkpoint the 2 ranks wrote resumes in 1 process exactly where an uninterrupted run would be."""
    ckpt = tmp_path / "ckpt"
    proc = _start_torchrun(tmp_path, "--save-to", str(ckpt))
    example = _example()
    refs, whole = _meanwhile(proc.kill, lambda: (_references(2, 2, ["deepspeed", "accelerator"]),
                                                example.train("deepspeed", 4, 1, 0, steps=5)))
    results = _torchrun_results(proc, tmp_path)
    _check_parity(results, 2, 2, ["deepspeed", "accelerator"], refs)
    resumed = example.train("deepspeed", 4, 1, 0, steps=5, resume_from=ckpt)
    assert len(resumed["losses"]) == 4  # steps 4 and 5, two micro-batches each
    gaps = parity_gaps({**whole, "losses": whole["losses"][6:], "norms": whole["norms"][3:]}, resumed)
    assert gaps["losses"] <= TOL and gaps["norms"] <= TOL and gaps["params"] <= TOL, gaps


@pytest.mark.slow
def test_three_ranks_match_one_process_and_negative_control(tmp_path):
    """3 gloo ranks x micro-batch 1 == 1 process x micro-batch 3, also when every micro-batch's backward averages;
    with the averaging skipped (the negative control) the same comparison fails by far more than the tolerance."""
    args = {"faces": ["deepspeed", "accelerator"], "micro": 1, "steps": 3, "accumulation": 2, "watchdog_s": 120.0,
            "every_sync": True, "control": "skip_average", "slow_updates": True}
    ranks = Ranks(3, [str(WORKER), str(tmp_path), json.dumps(args)], tmp_path)
    refs = _meanwhile(ranks.kill, lambda: _references(3, 1, ["deepspeed", "accelerator", "every_sync"]))
    codes = ranks.wait()
    assert codes == [0, 0, 0], ranks.log(0)[-3000:]
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(3)]
    # One host store for the node: every layer's gradients went to its owner, each backward (2 layers x 12).
    assert all(res["owner_reductions"] == 2 * 12 for res in results), [res["owner_reductions"] for res in results]
    # The DeepSpeed face overlaps the layer updates (optimizer_overlap): one token per layer per step tells the
    # other ranks a layer's owner has updated it (2 layers x 3 steps); the Accelerator face does not overlap.
    assert all(res["update_tokens"] == 2 * 3 for res in results), [res["update_tokens"] for res in results]
    _check_parity(results, 3, 1, ["deepspeed", "accelerator", "every_sync"], refs)
    ref = refs["deepspeed"]  # the one-process run at micro-batch 3, as above
    gaps = parity_gaps(ref, results[0]["control"])
    assert gaps["params"] > 100 * TOL and gaps["norms"] > 100 * TOL, gaps
    # Owners slower than the others' next forward: still exact, as the layer-update tokens hold the loads back;
    # without the tokens some rank trains on a layer its owner has not written yet.
    for r in range(3):
        gaps = parity_gaps(ref, results[r]["slow_updates"])
        assert max(gaps.values()) <= TOL, (r, gaps)
    # What the control catches is a rank reading a layer its owner has not written yet: one missed Adam update,
    # about lr (1e-3) per weight. 10 x TOL: ten times below that signal, hundreds of times above the parity gaps
    # (~3e-7); at 100 x TOL the threshold sat on the signal itself (measured 1.0033e-3).
    assert max(max(parity_gaps(ref, results[r]["slow_no_tokens"]).values()) for r in range(3)) > 10 * TOL


@pytest.mark.slow
def test_two_nodes_of_two_ranks_match_one_process(tmp_path):
    """2 nodes x 2 ranks (told apart by GROUP_RANK, as torchrun's agents on two hosts): each node holds its own
    shared store, the owners of a layer on both nodes all-reduce its gradients, and 4 ranks x micro-batch 1 train as
    1 process x micro-batch 4; every rank ends with the same weights."""
    args = {"faces": ["deepspeed"], "micro": 1, "steps": 3, "accumulation": 2, "watchdog_s": 120.0}
    ranks = Ranks(4, [str(WORKER), str(tmp_path), json.dumps(args)], tmp_path, per_node=2)
    refs = _meanwhile(ranks.kill, lambda: _references(4, 1, ["deepspeed"]))
    codes = ranks.wait()
    assert codes == [0, 0, 0, 0], ranks.log(0)[-3000:]
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    assert all(res["owner_reductions"] == 2 * 6 for res in results)
    _check_parity(results, 4, 1, ["deepspeed"], refs)


@pytest.mark.slow
def test_weights_written_on_one_rank_reach_every_rank(tmp_path):
    """GatheredParameters(modifier_rank=0) with rank 0 alone writing an embedding row and a layer another rank
    owns: after the next step every rank holds the same weights, shared or replicated store; without the
    broadcast (the negative control) the ranks differ."""
    ranks = Ranks(2, [str(ROOT / "tests" / "workers" / "dp_gathered_worker.py"), str(tmp_path)], tmp_path)
    codes = ranks.wait()
    assert codes == [0, 0], ranks.log(0)[-3000:] + ranks.log(1)[-3000:]
    a, b = (torch.load(tmp_path / f"gathered{r}.pt") for r in range(2))
    for host in ("shared", "replicated"):
        assert all(torch.equal(a[host][k], b[host][k]) for k in a[host]), host
        assert a[host]["model.embed_tokens.weight"][3].sub(0.5).abs().max() < 0.01  # the write, one step on
    assert not all(torch.equal(a["control"][k], b["control"][k]) for k in a["control"])
    # The sharded optimizer state: whole in rank 0's state_dict, rank 1's share refused on load.
    whole, share = a["optimizer"], b["optimizer"]
    assert whole["states"] == whole["params"] and not whole["refused"], whole
    assert share["states"] < share["params"] and share["refused"], share


def _start_torchrun(tmp_path: Path, *args: str) -> subprocess.Popen:
    with open(tmp_path / "torchrun.log", "w") as log:  # a file: nothing waits on an unread pipe
        return start_python(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", EXAMPLE,
                             "--micro-batch", "2", "--out", tmp_path, *args], env=_env(), stdout=log,
                            stderr=subprocess.STDOUT, text=True)


def _torchrun_results(proc: subprocess.Popen, tmp_path: Path) -> list[dict]:
    finish(proc, timeout=DEADLINE_S, log=tmp_path / "torchrun.log")
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]


@pytest.mark.deepspeed
@pytest.mark.slow
def test_zero3_baseline_at_the_same_world_size(tmp_path):
    """Real DeepSpeed ZeRO-3 offload, 2 ranks under torchrun through the same Accelerator and script, lands
    where MegaTrain's one-process run with the doubled micro-batch does."""
    proc = _start_torchrun(tmp_path, "--faces", "accelerator", "--backend", "zero3")
    refs = _meanwhile(proc.kill, lambda: _references(2, 2, ["accelerator"]))
    _check_parity(_torchrun_results(proc, tmp_path), 2, 2, ["accelerator"], refs)


@pytest.mark.slow
@pytest.mark.parametrize(("path", "face"), [("per_rank", "deepspeed"), ("node", "deepspeed"), ("node", "accelerator")])
@pytest.mark.parametrize("fault", ["die", "hang"])
def test_dead_or_hung_rank_stops_the_others_within_the_watchdog(tmp_path, fault, path, face):
    """Rank 1 exits or sleeps before its third forward; rank 0 stops with an error naming itself within the watchdog
    time. On the node path (every layer streamed) rank 0 then waits in a layer's all-gather: through the accelerator
    face always; the DeepSpeed face overlaps the layer updates, so a dead peer may surface first at an update token."""
    watchdog = 4.0
    args = {"faces": [face], "micro": 1, "steps": 3, "accumulation": 2, "watchdog_s": watchdog,
            "fault": fault}
    argv = [str(WORKER), str(tmp_path), json.dumps(args)]
    ranks = Ranks(2, [str(NODE_WORKER), *argv] if path == "node" else argv, tmp_path)
    try:
        codes = ranks.wait([0])
    finally:
        ranks.kill()  # the hung rank sleeps on
    log = ranks.log(0)
    assert codes[0] not in (0, None), log[-3000:]
    assert "data parallel rank 0 of 2" in log and "A peer rank died, hung" in log, log[-3000:]
    if fault == "die":
        assert codes[1] == 17
    fault_time = float((tmp_path / "fault_time").read_text())
    # Stopped within the watchdog time of the fault (plus slack for a loaded machine's interpreter exit).
    assert ranks.exit_time[0] - fault_time <= watchdog + 10.0, ranks.exit_time[0] - fault_time
    if path == "node":  # the engine that met the fault ran the node path
        chosen = (tmp_path / "rank0_paths.txt").read_text().splitlines()
        assert chosen and chosen[-1].startswith("node:"), chosen
        if face == "accelerator":  # the node path's collective itself raised the named error
            assert "data parallel rank 0 of 2: all-gathering a layer's weights across the node failed" in log, log[-3000:]


class SlowIdentityAverage:
    """Stands in for the engine's DataParallel with one rank: an "average" that reads a slab, waits, and
    writes the read values back, on its own thread, as a collective does. A gradient added into the slab
    while it runs is lost, so any missing wait changes the weights; with the waits the run is bit-identical
    to one without data parallel."""

    rank, world_size, local_rank = 0, 1, 0

    def __init__(self, trace, slow: str) -> None:
        from megatrain.engine.runtime.stream import CopyStream

        self.stream = CopyStream("allreduce", torch.device("cpu"), trace, None, 30.0)
        self.slow = slow
        self.trace = trace
        self.queued: list[tuple[int, float]] = []  # (layer, when its average was queued)

    def submit_average(self, group, after, what, layer):
        self.queued.append((layer, self.trace.now()))
        hold = 0.25 if (layer < 0) == (self.slow == "globals") else 0.0

        def job() -> int:
            read = group.grad.clone()
            time.sleep(hold)
            group.grad.copy_(read)
            return 0

        return self.stream.submit(job, after, "average", layer)


@pytest.mark.parametrize("slow", ["layers", "globals"])
def test_gradient_adds_wait_for_a_running_average(slow):
    from conftest import make_batches, tiny_model

    from megatrain.config.schema import EngineConfig
    from megatrain.engine import Engine
    from megatrain.engine.parallel.ranks import Replicated

    batches = make_batches(4, batch=2, seq=16)
    weights = []
    for fake in (False, True):
        eng = Engine(tiny_model(layers=3), EngineConfig(device="cpu", parity_probe=False, trace=fake))
        if fake:
            eng.ranks = Replicated(SlowIdentityAverage(eng.trace_log, slow), eng.store, eng.events)
        for b in batches:  # every backward averages, so the next one's adds meet a running average
            eng.backward(eng(**b).loss, sync=True)
        eng.step()
        weights.append(eng.state_dict())
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    # Each layer's average was queued as its gradients left backward, before the next layer's backward
    # began (it then runs on its own thread, overlapping that backward); the resident parameters' last.
    bwd = [r for r in eng.trace if r.stream == "compute" and r.kind == "bwd"]
    queued = eng.ranks.dp.queued
    assert [layer for layer, _ in queued] == [2, 1, 0, -1] * len(batches)
    for n in range(len(batches)):
        for (layer, t), nxt in zip(queued[4 * n: 4 * n + 2], bwd[3 * n + 1: 3 * n + 3], strict=True):
            assert nxt.layer == layer - 1 and t <= nxt.t_start


# ---------------------------------------------------------------------------------------------------
# the pieces around the engine, in this process


def test_batch_sizes_split_over_the_world_as_deepspeed_does():
    from megatrain.config.deepspeed import parse_config

    c = parse_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, world_size=4)
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (24, 2, 3)
    c = parse_config({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 2}, world_size=4)
    assert c.gradient_accumulation_steps == 3
    with pytest.raises(ValueError, match=r"world size \(4\) = 16"):
        parse_config({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2},
                     world_size=4)


def test_launch_environment_is_checked(monkeypatch):
    from megatrain import Accelerator
    from megatrain.engine.parallel.distributed import launch_env

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="RANK is not set"):
        launch_env()
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match="RANK=2 is outside WORLD_SIZE=2"):
        launch_env()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert launch_env() == (1, 2, 1)
    with pytest.raises(ValueError, match="backend='torch' runs one process"):
        Accelerator(backend="torch")
