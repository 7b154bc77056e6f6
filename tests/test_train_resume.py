"""`megatrain train --config` never loses a run: stopped by SIGINT or SIGTERM after a checkpoint, the same command
resumes from the newest whole checkpoint and ends with the losses and weights of an uninterrupted run, bit for
bit; --restart starts over; an output folder it must not resume is refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "sft" / "sft.yaml"
DRIVER = Path(__file__).with_name("sft_signal_driver.py")
# short and without evaluation: the point is the checkpoints, not the training
SETS = ("max_steps=6", "save_steps=2", "eval_data=null")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="2")
    return env


def _args(out: Path, *sets: str) -> list[str]:
    return ["train", "--config", str(EXAMPLE), *(a for s in (f"output_dir={out}", f"report={out}/report.json",
                                                             *SETS, *sets) for a in ("--set", s))]


def _run(out: Path, *extra: str, sets: tuple = ()) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatrain.cli", *_args(out, *sets), *extra], env=_env(),
                          capture_output=True, text=True, timeout=600)


def _stopped(out: Path, sig: int, at: int = 2) -> subprocess.CompletedProcess:
    """The run stopped by `sig`, sent from here once its checkpoint at step `at` is whole."""
    ready = out.parent / f"{out.name}.ready"
    p = subprocess.Popen([sys.executable, str(DRIVER), str(at), str(ready), *_args(out)], env=_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while not ready.exists() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    p.send_signal(sig)
    stdout, stderr = p.communicate(timeout=600)
    return subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)


def _report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


def test_a_run_stopped_by_sigint_resumes_bit_identically(tmp_path):
    whole = _run(tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    ref = _report(tmp_path / "whole")

    out = tmp_path / "run"
    r = _stopped(out, signal.SIGINT)
    assert r.returncode == 130, r.stderr[-3000:]
    # the step in flight when the signal came (3) finished and was checkpointed
    assert "stopped on SIGINT after step 3; checkpoint saved to" in r.stderr, r.stderr[-3000:]
    assert (out / "checkpoint-3" / "megatrain_whole").is_file() and not (out / "final").exists()
    assert _report(out)["stopped"] == "SIGINT"

    again = _run(out)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming from {out / 'checkpoint-3'} (step 3" in again.stderr
    rep = _report(out)
    assert rep["resumed_from"] == str(out / "checkpoint-3")
    assert rep["engine"] == "MegaTrainEngine" and len(ref["losses"]) == 6
    assert rep["losses"] == ref["losses"]  # bit-identical, including steps 4-6 trained after the resume
    a, b = load_file(out / "final" / "model.safetensors"), load_file(tmp_path / "whole" / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)

    # run to the end: the same command again has nothing to resume and says so
    done = _run(out)
    assert done.returncode == 2 and "finished" in done.stderr and "--restart" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_restart_and_other_settings_after_sigterm(tmp_path):
    out = tmp_path / "run"
    r = _stopped(out, signal.SIGTERM)
    assert r.returncode == 143 and "stopped on SIGTERM after step 3" in r.stderr, r.stderr[-3000:]

    # other settings in the same folder: refused in one line before anything is touched
    other = _run(out, sets=("learning_rate=0.002",))
    assert other.returncode == 2, other.stderr[-3000:]
    line = other.stderr.strip()
    assert len(line.splitlines()) == 1 and "learning_rate: 0.001 -> 0.002" in line and "--restart" in line
    assert (out / "checkpoint-3" / "megatrain_whole").is_file()

    # a checkpoint a kill cut short is not resumed from: the newest whole one is, and the stub is removed
    (out / "checkpoint-4").mkdir()
    again = _run(out, "--restart", sets=("learning_rate=0.002",))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "--restart: starting over" in again.stderr and "resuming" not in again.stderr
    rep = _report(out)
    assert rep["resumed_from"] is None and sorted(map(int, rep["losses"])) == [1, 2, 3, 4, 5, 6]
    assert not (out / "checkpoint-3").exists()  # the earlier run's checkpoints went, the new run's are whole
    assert all((p / "megatrain_whole").is_file() for p in out.glob("checkpoint-*"))
