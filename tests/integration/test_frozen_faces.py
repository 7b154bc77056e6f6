"""Part of a model through the launchers and trainers users run: HF Trainer with the embedding frozen, and two ranks
under torchrun (tests/workers/frozen_trainer.py, tests/workers/frozen_dp_worker.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from kit import finish, run_python, start_python, worker_env

ROOT = Path(__file__).resolve().parents[2]
WORKERS = ROOT / "tests" / "workers"
TOL = 1e-5


def _report(out: str) -> dict:
    line = next(ln for ln in out.splitlines() if ln.startswith("REPORT "))
    return json.loads(line[len("REPORT "):])


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory) -> dict:
    """frozen_trainer.py's cases, plain and on MegaTrain, all in one process (torch, transformers and PEFT imported
    once): the embedding frozen, and the PEFT LoRA model where PEFT is installed."""
    import importlib.util

    tmp = tmp_path_factory.mktemp("frozen_trainer")
    whats = ["embedding"] + (["lora"] if importlib.util.find_spec("peft") is not None else [])
    out = run_python([WORKERS / "frozen_trainer.py", tmp, *whats], cwd=tmp,
                     env=worker_env(world_size=1, threads=2), timeout=600, check=True).stdout
    return _report(out)


def test_hf_trainer_with_the_embedding_frozen_trains_as_plain_pytorch(trainer_runs):
    r = trainer_runs["embedding"]
    plain, mine = r["plain"], r["megatrain"]
    assert mine["engine"] == "MegaTrainEngine" and plain["engine"] != "MegaTrainEngine"
    assert len(mine["losses"]) == len(plain["losses"]) == 5
    assert max(abs(a - b) for a, b in zip(mine["losses"], plain["losses"])) <= TOL
    assert all(abs(a - b) <= TOL * b for a, b in zip(mine["grad_norms"], plain["grad_norms"])), r
    assert min(plain["grad_norms"]) > 1.0  # control: every step's clip bites
    assert not mine["embedding_moved"] and not plain["embedding_moved"]
    assert mine["frozen_flags"] == plain["frozen_flags"] == ["model.embed_tokens.weight"]


@pytest.mark.slow
def test_hf_trainer_with_a_peft_lora_model_trains_as_plain_peft(trainer_runs):
    """A PEFT LoRA model (r 8 on q/v) through the same Trainer: losses as plain PEFT, PEFT's adapter files written."""
    pytest.importorskip("peft")
    r = trainer_runs["lora"]
    plain, mine = r["plain"], r["megatrain"]
    assert mine["engine"] == "MegaTrainEngine" and len(mine["losses"]) == len(plain["losses"]) == 5
    assert max(abs(a - b) for a, b in zip(mine["losses"], plain["losses"])) <= TOL
    assert all(abs(a - b) <= TOL * b for a, b in zip(mine["grad_norms"], plain["grad_norms"])), r
    assert max(plain["grad_norms"]) > 0.25  # control: the clip bites
    assert "adapter_model.safetensors" in mine["files"] and mine["files"] == plain["files"]
    assert not mine["embedding_moved"] and mine["frozen_flags"] == plain["frozen_flags"]
    assert len(mine["frozen_flags"]) > 10  # PEFT froze the base


@pytest.mark.slow
def test_trl_sft_trainer_with_a_peft_config_trains_as_plain_trl(tmp_path):
    """SFTTrainer(peft_config=LoRA r 8 on q/v), 8 steps clipped, accumulation 2: MegaTrain's losses and norms within
    1e-5 of plain TRL's, PEFT's adapter files written."""
    pytest.importorskip("peft")
    # The two runs side by side (each mostly its single-threaded start-up; neither reads the other's files), each in
    # a process of its own: importing MegaTrain's Trainer routing would route the plain run too.
    procs = {where: start_python([WORKERS / "frozen_trl_lora.py", tmp_path / where, where], cwd=tmp_path,
                                 env=worker_env(world_size=1, threads=2), log=tmp_path / f"{where}.log")
             for where in ("plain", "megatrain")}
    runs = {}
    for where, proc in procs.items():
        finish(proc, timeout=600, log=tmp_path / f"{where}.log")
        runs[where] = _report((tmp_path / f"{where}.log").read_text())
    plain, mine = runs["plain"], runs["megatrain"]
    assert mine["engine"] == "MegaTrainEngine" and plain["engine"] != "MegaTrainEngine"
    assert len(mine["losses"]) == len(plain["losses"]) == 8
    assert max(abs(a - b) for a, b in zip(mine["losses"], plain["losses"])) <= TOL
    assert all(abs(a - b) <= TOL * b for a, b in zip(mine["grad_norms"], plain["grad_norms"])), runs
    assert max(plain["grad_norms"]) > 0.3  # control: the clip bites
    assert "adapter_model.safetensors" in mine["files"] and mine["files"] == plain["files"]


def _dp_reference(case: str) -> tuple[list, list]:
    """Plain PyTorch on what two ranks see: the mean of the two ranks' losses' gradients, clipped over the
    trainable parameters (per step: (rank 0's loss, rank 1's), the pre-clip norm)."""
    from frozen_cases import BATCHES_DP, CLIP, LR, STEPS, build

    model = build(case)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR)
    losses, norms = [], []
    for s in range(STEPS):
        pair = [model(**BATCHES_DP[2 * s + r]).loss for r in (0, 1)]
        ((pair[0] + pair[1]) / 2).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append([x.item() for x in pair])
    return losses, norms


def test_two_ranks_under_torchrun_train_only_what_the_user_left_trainable(tmp_path):
    log = tmp_path / "torchrun.log"
    proc = start_python(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                         WORKERS / "frozen_dp_worker.py", tmp_path], env=worker_env(threads=1), log=log)
    from frozen_cases import dp_cases

    try:  # the references here while the ranks run (they read nothing the ranks write)
        refs = {case: _dp_reference(case) for case in dp_cases()}
    except BaseException:
        proc.kill()
        raise
    finish(proc, timeout=600, log=log)
    results = json.loads((tmp_path / "results.json").read_text())
    assert sorted(results) == sorted(dp_cases())
    for case, ranks in results.items():
        losses, norms = refs[case]
        for r, got in enumerate(ranks):
            assert max(abs(a - b[r]) for a, b in zip(got["losses"], losses)) <= TOL, (case, r, got, losses)
            assert all(abs(a - b) <= TOL * b for a, b in zip(got["norms"], norms)), (case, got["norms"], norms)
            assert not got["moved"] and got["flags"], (case, got)
        assert min(norms) > 1.0 or case == "lora"  # control: every step's clip bites (LoRA's norms are smaller)
