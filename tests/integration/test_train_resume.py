"""`megatrain train --config` never loses a run: stopped by SIGINT or SIGTERM after a checkpoint, the same command
resumes from the newest whole checkpoint and ends with the losses and weights of an uninterrupted run, bit for
bit; --restart starts over; an output folder it must not resume is refused."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from kit import run_python, start_python, worker_env
from safetensors.torch import load_file

from megatrain.commands.sft_resume import RUN_FILE, WHOLE_MARK, RefusedOutput, SaveCallback, prepare_output

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "sft" / "sft.yaml"
DRIVER = Path(__file__).resolve().parents[1] / "workers" / "sft_signal_driver.py"
# short and without evaluation: the point is the checkpoints, not the training
SETS = ("max_steps=6", "save_steps=2", "eval_data=null")


def _args(out: Path, *sets: str) -> list[str]:
    return ["train", "--config", str(EXAMPLE), *(a for s in (f"output_dir={out}", f"report={out}/report.json",
                                                             *SETS, *sets) for a in ("--set", s))]


def _run(out: Path, *extra: str, sets: tuple = ()) -> subprocess.CompletedProcess:
    return run_python(["-m", "megatrain.commands.cli", *_args(out, *sets), *extra], env=worker_env(threads=2),
                      timeout=600)


def _stopped(out: Path, sig: int, at: int = 2) -> subprocess.CompletedProcess:
    """The run stopped by `sig`, sent from here once its checkpoint at step `at` is whole."""
    ready = out.parent / f"{out.name}.ready"
    p = start_python([DRIVER, at, ready, *_args(out)], env=worker_env(threads=2), stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while not ready.exists() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    p.send_signal(sig)
    stdout, stderr = p.communicate(timeout=600)
    return subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)


def _report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


def _read(path: Path, read=lambda p: json.loads(p.read_text())):
    """What a run left at `path` (a report or weights), None where it left nothing (its test then says why)."""
    return read(path) if path.is_file() else None


@pytest.fixture(scope="module")
def sigint_story(tmp_path_factory) -> dict:
    """One run stopped by SIGINT, then the same command three times (resume, nothing left to resume, --restart),
    with what each left behind read at once. The --restart run, uninterrupted from step 1, is also the reference
    of the num_buffers resume below: the same settings, so one uninterrupted run serves both."""
    out = tmp_path_factory.mktemp("sigint") / "run"
    story: dict = {"out": out, "stopped": _stopped(out, signal.SIGINT)}
    story["left"] = ((out / "checkpoint-3" / WHOLE_MARK).is_file(), (out / "final").exists())
    story["stopped_report"] = _read(out / "report.json")
    story["again"] = _run(out)
    story["resumed"], story["weights"] = _read(out / "report.json"), _read(out / "final" / "model.safetensors",
                                                                          load_file)
    story["done"] = _run(out)
    story["whole"] = _run(out, "--restart")
    story["ref"], story["ref_weights"] = _read(out / "report.json"), _read(out / "final" / "model.safetensors",
                                                                          load_file)
    return story


@pytest.mark.slow
def test_a_run_stopped_by_sigint_resumes_bit_identically(sigint_story):
    out, r = sigint_story["out"], sigint_story["stopped"]
    assert r.returncode == 130, r.stderr[-3000:]
    # the step in flight when the signal came (3) finished and was checkpointed
    assert "stopped on SIGINT after step 3; checkpoint saved to" in r.stderr, r.stderr[-3000:]
    assert sigint_story["left"] == (True, False)  # checkpoint-3 whole, no final/
    assert sigint_story["stopped_report"]["stopped"] == "SIGINT"

    again = sigint_story["again"]
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming from {out / 'checkpoint-3'} (step 3" in again.stderr
    resumed = sigint_story["resumed"]
    assert resumed["resumed_from"] == str(out / "checkpoint-3") and resumed["engine"] == "MegaTrainEngine"
    weights = sigint_story["weights"]

    # run to the end: the same command again has nothing to resume and says so, in one line
    done = sigint_story["done"]
    assert done.returncode == 2 and "finished" in done.stderr and "--restart" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1

    # --restart: the same run from step 1, uninterrupted, is the reference
    whole = sigint_story["whole"]
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert "--restart: starting over" in whole.stderr and "resuming" not in whole.stderr
    ref = sigint_story["ref"]
    assert ref["resumed_from"] is None and len(ref["losses"]) == 6
    assert resumed["losses"] == ref["losses"]  # bit-identical, steps 4-6 trained after the resume included
    again_weights = sigint_story["ref_weights"]
    assert weights.keys() == again_weights.keys() and all(weights[k].equal(again_weights[k]) for k in weights)


@pytest.fixture(scope="module")
def _sigterm_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """One run stopped by SIGTERM after its checkpoint at step 2 (the step in flight, 3, checkpointed too), and a
    pristine copy of its output folder: two tests start from that state, each from its own fresh copy."""
    base = tmp_path_factory.mktemp("sigterm")
    out = base / "run"
    r = _stopped(out, signal.SIGTERM)
    shutil.copytree(out, base / "pristine")
    return r, out, base / "pristine"


@pytest.fixture
def sigterm_stopped(_sigterm_run) -> tuple[subprocess.CompletedProcess, Path]:
    """The SIGTERM-stopped run's output folder as the stop left it, at the path it was written to: the run's
    recorded settings name that output_dir, so a resume elsewhere would be (rightly) refused."""
    r, out, pristine = _sigterm_run
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(pristine, out)
    return r, out


@pytest.mark.slow
def test_sigterm_then_other_settings_are_refused(sigterm_stopped):
    r, out = sigterm_stopped
    assert r.returncode == 143 and "stopped on SIGTERM after step 3" in r.stderr, r.stderr[-3000:]
    other = _run(out, sets=("learning_rate=0.002",))
    assert other.returncode == 2, other.stderr[-3000:]
    line = other.stderr.strip()
    assert len(line.splitlines()) == 1 and "learning_rate: 0.001 -> 0.002" in line and "--restart" in line
    assert (out / "checkpoint-3" / WHOLE_MARK).is_file()  # nothing touched


def _earlier_run(out: Path, steps: dict[int, bool], settings: dict | None = None, finished: bool = False) -> None:
    out.mkdir(parents=True)
    for step, whole in steps.items():
        (out / f"checkpoint-{step}").mkdir()
        if whole:
            (out / f"checkpoint-{step}" / WHOLE_MARK).write_text("{}")
    if settings is not None:
        (out / RUN_FILE).write_text(json.dumps({"settings": settings, "finished": finished}))


def test_which_checkpoint_a_run_resumes_from(tmp_path):
    s = {"learning_rate": 0.001, "report": "a.json"}
    out = tmp_path / "a"
    _earlier_run(out, {2: True, 4: True, 6: False}, s)
    where, note = prepare_output(out, {**s, "report": "b.json"}, restart=False)  # report may change
    assert where == out / "checkpoint-4" and "resuming from" in note
    assert not (out / "checkpoint-6").exists()  # the half-written one, which the run would write over, is gone

    out = tmp_path / "b"
    _earlier_run(out, {2: False}, s)
    with pytest.raises(RefusedOutput, match="only half-written checkpoints \\(checkpoint-2\\).*--restart"):
        prepare_output(out, s, restart=False)
    out = tmp_path / "c"
    _earlier_run(out, {2: True})
    with pytest.raises(RefusedOutput, match="without its settings"):
        prepare_output(out, s, restart=False)
    out = tmp_path / "d"
    _earlier_run(out, {}, s, finished=True)
    with pytest.raises(RefusedOutput, match="finished"):
        prepare_output(out, s, restart=False)

    # --restart removes this command's own output only
    out = tmp_path / "e"
    _earlier_run(out, {2: True, 4: False}, s, finished=True)
    (out / "final").mkdir()
    (out / "notes.txt").write_text("mine")
    where, note = prepare_output(out, s, restart=True)
    assert where is None and "removed 3 folder(s)" in note
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    out = tmp_path / "f"
    _earlier_run(out, {}, s)  # stopped before its first checkpoint
    assert prepare_output(out, s, restart=False) == (None, f"no checkpoint of the earlier run in {out}: starting at "
                                                           "step 1")
    assert prepare_output(tmp_path / "new", s, restart=False) == (None, "")
    assert not (tmp_path / "new").exists()


def test_when_the_callback_asks_for_a_checkpoint(monkeypatch):
    from megatrain.commands import sft_resume

    now = [1000.0]
    monkeypatch.setattr(sft_resume.time, "monotonic", lambda: now[0])
    stop = SimpleNamespace(requested=False)
    cb = SaveCallback(stop, save_minutes=30, save_steps=0)
    cb.on_train_begin(None, None, None)

    def step(n: int, max_steps: int = 100) -> SimpleNamespace:
        control = SimpleNamespace(should_save=n == max_steps, should_training_stop=False)  # as Trainer's flow
        cb.on_step_end(None, SimpleNamespace(global_step=n, max_steps=max_steps), control)
        return control

    assert not step(1).should_save
    now[0] += 30 * 60
    assert step(2).should_save  # 30 minutes of training since the last checkpoint
    cb.on_save(SimpleNamespace(output_dir="/nonexistent"), SimpleNamespace(global_step=2), None)
    assert not step(3).should_save  # the clock starts again at each checkpoint
    assert not step(100).should_save  # the end: final/ holds the weights, no last checkpoint
    stop.requested = True
    c = step(4)
    assert c.should_save and c.should_training_stop and cb.stopped_at == 4


@pytest.mark.slow
def test_a_resume_with_only_num_buffers_changed_is_bit_identical(sigterm_stopped, sigint_story):
    """`--set megatrain.num_buffers=3` merges into the file's section and, as a setting that changes no computed
    value, is accepted on resume; the resumed run's losses and weights are an uninterrupted run's, bit for bit
    (the SIGINT story's --restart run: the same settings from step 1, uninterrupted). A setting that can change
    the arithmetic is still refused, by its dotted name (the control)."""
    r, out = sigterm_stopped
    assert r.returncode == 143, r.stderr[-3000:]
    other = _run(out, sets=("megatrain.loss_chunk_tokens=7",))
    assert other.returncode == 2 and "megatrain.loss_chunk_tokens: None -> 7" in other.stderr, other.stderr[-3000:]
    again = _run(out, sets=("megatrain.num_buffers=3",))
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming from {out / 'checkpoint-3'} (step 3" in again.stderr
    recorded = json.loads((out / RUN_FILE).read_text())["settings"]["megatrain"]
    assert recorded["num_buffers"] == 3 and recorded["host_master"] == "fp32"  # merged: the file's key kept
    resumed, weights = _report(out), load_file(out / "final" / "model.safetensors")
    whole, ref = sigint_story["whole"], sigint_story["ref"]
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert ref["resumed_from"] is None and resumed["losses"] == ref["losses"]
    ref_weights = sigint_story["ref_weights"]
    assert all(weights[k].equal(ref_weights[k]) for k in weights)
