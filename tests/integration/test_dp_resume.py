"""Checkpoints across world sizes, both faces: a checkpoint written with N ranks resumes with M != N ranks
(fewer or more) exactly where an uninterrupted run lands.

The global micro-batch is 6 rows throughout, split as 1 rank x 6, 2 ranks x 3 or 3 ranks x 2: a resume
with a different world size keeps the global batch (a fixed per-rank micro-batch would change it, and
with it the training). The reference is one process with micro-batch 6 for the whole run, 3 steps saved
and 2 more resumed (two micro-batches of accumulation each), whose losses, norms and weights every
resumed run must match within TOL: which rows each rank reads after the resume is the example's (global
micro-batch j is rows [6j, 6j + 6), rank r of N takes its slice), so matching losses also prove the data
continues at the right global step.

Two launches in all: 2 ranks (resume a 1-process checkpoint, then train afresh and save), then 3 ranks
(resume the 2-rank checkpoint); the 1-process saves and resumes run in this process.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from dp_resume_worker import snapshot
from examples_module import load_example
from kit import parity_gaps
from test_data_parallel import TOL, Ranks

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "workers" / "dp_resume_worker.py"
GLOBAL_MICRO = 6  # rows per global micro-batch: 1 x 6 = 2 x 3 = 3 x 2
SAVED_STEPS, TOTAL_STEPS, ACCUMULATION = 3, 5, 2
FACES = ("deepspeed", "accelerator")


def _launch(world: int, phases: list[dict[str, Any]], tmp: Path, meanwhile=lambda: None) -> tuple[list, Any]:
    """One bounded multi-process run of the worker: every rank's results, and what `meanwhile()` returned (run
    here while the ranks run: work that reads nothing they write)."""
    tmp.mkdir(parents=True)
    args = {"micro": GLOBAL_MICRO // world, "watchdog_s": 120.0, "delay_s": 1.0, "phases": phases}
    ranks = Ranks(world, [str(WORKER), str(tmp), json.dumps(args)], tmp)
    try:
        done_here = meanwhile()
    except BaseException:
        ranks.kill()
        raise
    codes = ranks.wait()
    assert codes == [0] * world, "\n".join(ranks.log(r)[-3000:] for r in range(world))
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)], done_here


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("dp_resume")
    example = load_example("train_data_parallel")
    one, two = tmp / "ckpt_1rank", tmp / "ckpt_2ranks"
    out: dict[str, Any] = {"example": example}
    example.run(list(FACES), GLOBAL_MICRO, SAVED_STEPS, ACCUMULATION, 60.0, save_to=one)
    # The uninterrupted reference trains here while the 2 ranks run.
    out["two"], out["whole"] = _launch(
        2, [{"key": "1to2", "steps": TOTAL_STEPS, "resume_from": str(one)},
            {"key": "fresh", "steps": SAVED_STEPS, "save_to": str(two), "automatic_naming": str(tmp / "project")}],
        tmp / "launch2", lambda: {face: example.train(face, GLOBAL_MICRO, 1, 0, steps=TOTAL_STEPS) for face in FACES})
    # The folders as the 2 ranks left them, before anything else can touch them.
    out["final"] = {face: snapshot(example.checkpoint_dir(two, face)) for face in FACES}
    out["inner"] = example.checkpoint_dir(two, "accelerator").relative_to(two)
    out["folders"] = {face: str(example.checkpoint_dir(two, face)) for face in FACES}
    out["project"] = tmp / "project"
    out["project_final"] = {p.name: snapshot(p) for p in (tmp / "project" / "checkpoints").iterdir()}
    # The 2 -> 1 resume here while the 3 ranks resume the same checkpoint (each only reads it).
    out["three"], out["2to1"] = _launch(
        3, [{"key": "2to3", "steps": TOTAL_STEPS, "resume_from": str(two)}], tmp / "launch3",
        lambda: example.run(list(FACES), GLOBAL_MICRO, TOTAL_STEPS, ACCUMULATION, 60.0, resume_from=two))
    out["two_ranks_ckpt"] = two
    return out


def _resumed_part(whole: dict[str, Any]) -> dict[str, Any]:
    done = SAVED_STEPS * ACCUMULATION
    return {**whole, "losses": whole["losses"][done:], "norms": whole["norms"][SAVED_STEPS:]}


def _check_resumed(runs: dict[str, Any], face: str, per_rank: list[dict[str, Any]], what: str) -> None:
    ref = _resumed_part(runs["whole"][face])
    got = per_rank[0][face]
    # The resumed run trains only the remaining micro-batches: it continued at global step SAVED_STEPS.
    assert len(got["losses"]) == (TOTAL_STEPS - SAVED_STEPS) * ACCUMULATION, (face, what, got["losses"])
    gaps = parity_gaps(ref, got)
    assert gaps["losses"] <= TOL and gaps["norms"] <= TOL and gaps["params"] <= TOL, (face, what, gaps)
    for r, other in enumerate(per_rank[1:], start=1):  # and every rank ends with the very same weights
        assert all(torch.equal(got["state"][k], v) for k, v in other[face]["state"].items()), (face, what, r)


@pytest.mark.slow
@pytest.mark.parametrize("face", FACES)
def test_checkpoint_resumes_on_more_and_fewer_ranks(runs: dict[str, Any], face: str) -> None:
    """1 -> 2, 2 -> 3 and 2 -> 1 ranks (global micro-batch 6 throughout: 1 x 6, 2 x 3, 3 x 2), through the
    DeepSpeed face (save_checkpoint / load_checkpoint) and the accelerator face (save_state / load_state,
    with its optimizer, LR scheduler and a registered progress counter): each resumed run's per-micro-batch
    losses, per-step norms and final weights match one process trained for the whole run."""
    whole = runs["whole"][face]
    assert len(whole["norms"]) == TOTAL_STEPS and min(whole["norms"]) > 2 * runs["example"].CLIP  # clipping acts
    # The 2-rank run that wrote the checkpoint was itself on the reference's path.
    fresh = runs["two"][0]["fresh"][face]
    saved_part = {"losses": whole["losses"][: SAVED_STEPS * ACCUMULATION], "norms": whole["norms"][:SAVED_STEPS]}
    assert max(abs(a - b) for a, b in zip(saved_part["losses"], fresh["losses"], strict=True)) <= TOL, face
    _check_resumed(runs, face, [r["1to2"] for r in runs["two"]], "1 -> 2 ranks")
    _check_resumed(runs, face, [r["2to3"] for r in runs["three"]], "2 -> 3 ranks")
    _check_resumed(runs, face, [runs["2to1"]], "2 -> 1 rank")


@pytest.mark.slow
@pytest.mark.parametrize("face", FACES)
def test_every_rank_returns_from_a_save_only_once_the_checkpoint_is_whole(runs: dict[str, Any], face: str) -> None:
    """Every rank calls the save (as DeepSpeed and Accelerate scripts do) and rank 0 arrives a second late;
    still, what each rank finds right after its call returns is the final folder, file for file: no rank
    returns while the checkpoint is half-written, and none deletes a part of it afterwards."""
    def own(files: dict[str, str]) -> dict[str, str]:
        # The DeepSpeed face's root also holds the accelerator face's folder, saved after it.
        inner = f"{runs['inner']}/"
        return {k: v for k, v in files.items() if face != "deepspeed" or not k.startswith(inner)}

    final = own(runs["final"][face])
    assert final, face
    for r, result in enumerate(runs["two"]):
        views = [v for v in result["views"] if v["face"] == face and v["folder"] == runs["folders"][face]]
        assert len(views) == 1, (face, r, views)
        seen = own(views[0]["files"])
        missing, extra = sorted(set(final) - set(seen)), sorted(set(seen) - set(final))
        changed = sorted(k for k in set(final) & set(seen) if final[k] != seen[k])
        assert not (missing or extra or changed), (face, r, missing, extra, changed)


@pytest.mark.slow
def test_every_rank_saving_under_automatic_naming_gets_the_same_whole_folder(runs: dict[str, Any]) -> None:
    """accelerate's automatic checkpoint naming with total_limit=1, `save_state()` called by both ranks twice:
    every rank is told the same folder, finds it whole when its call returns (rank 0 arriving late), the
    rotation leaves exactly the newest folder, and `load_state()` of the newest works on every rank."""
    root = runs["project"] / "checkpoints"
    expected = [str(root / f"checkpoint_{i}") for i in range(2)]
    assert sorted(runs["project_final"]) == ["checkpoint_1"], runs["project_final"].keys()
    final = runs["project_final"]["checkpoint_1"]
    assert "model.safetensors" in final and "optimizer.bin" in final, sorted(final)
    for r, result in enumerate(runs["two"]):
        auto = result["fresh_auto"]
        assert [str(p) for p in auto["paths"]] == expected, (r, auto["paths"])  # accelerate returns a Path
        assert auto["reloaded_equal"], r
        last = [v for v in result["views"] if v["folder"] == expected[-1]]
        assert len(last) == 1 and last[0]["files"] == final, (r, last)


@pytest.mark.slow
@pytest.mark.parametrize("face", FACES)
def test_resuming_without_the_optimizer_state_misses_by_far(runs: dict[str, Any], face: str) -> None:
    """The negative control: the same 2 -> 1 resume with Adam's moments left out (and, separately, the LR
    schedule left at its start) fails the comparison by far more than the tolerance."""
    example, ckpt = runs["example"], runs["two_ranks_ckpt"]
    ref = _resumed_part(runs["whole"][face])
    resume = example.checkpoint_dir(ckpt, face)
    no_adam = example.train(face, GLOBAL_MICRO, 1, 0, steps=TOTAL_STEPS, resume_from=resume, leave_out="optimizer")
    gaps = parity_gaps(ref, no_adam)
    assert gaps["params"] > 100 * TOL and gaps["norms"] > 100 * TOL and gaps["losses"] > 10 * TOL, (face, gaps)
    # The scheduler's LR reaches only the last update (the optimizer's groups carry the saved LR to the first).
    no_schedule = example.train(face, GLOBAL_MICRO, 1, 0, steps=TOTAL_STEPS, resume_from=resume,
                                leave_out="scheduler")
    assert parity_gaps(ref, no_schedule)["params"] > 10 * TOL, face


@pytest.mark.slow
def test_a_shared_store_save_is_one_shard_per_rank_and_whole_only_with_every_shard(runs: dict[str, Any],
                                                                                    tmp_path: Path) -> None:
    """The 2-rank DeepSpeed-face save (one host store per node) wrote no gathered state: rank 1's layers' Adam
    state is in rank 1's own shard file, listed in the manifest, and nowhere else; the checkpoint resumed on 1,
    2 and 3 ranks above. Without the shard (negative control) the load refuses it, naming the file."""
    import shutil

    from megatrain.run import checkpoint as ck

    root = Path(runs["folders"]["deepspeed"])
    tag = ck.latest_tag(root)
    path = root / tag
    manifest = json.loads((path / ck.MANIFEST_FILE).read_text())
    shard = f"{ck.SHARD_PREFIX}1.safetensors"
    assert shard in manifest["files"], sorted(manifest["files"])
    tensors, meta, _ = ck.load(root, tag)
    main, own = set(tensors.files[0]), set(tensors.files[1])
    assert own and all(k.startswith("optim.") for k in own) and not own & main
    wanted = {f"optim.{i}.{k}" for i, e in meta["optimizer"]["state"].items() for k, v in e.items()
              if v == "__in_tensors__"}
    assert wanted == {k for k in main | own if k.startswith("optim.")}  # every state tensor, each once
    tensors.close()
    copy = tmp_path / "ckpt"
    shutil.copytree(root, copy)
    (copy / tag / shard).unlink()
    with pytest.raises(ck.CheckpointError, match=shard):
        ck.load(copy, tag)


@pytest.mark.slow
def test_the_accelerator_face_saves_one_shard_per_rank_and_loads_only_with_every_shard(runs: dict[str, Any],
                                                                                       tmp_path: Path) -> None:
    """The 2-rank save_state (one host store per node) gathered nothing: each rank's layers' Adam state is in
    its own shard file, which optimizer.bin lists with its size and hash and holds no tensor of; the folder
    resumed on 1, 2 and 3 ranks above. A shard missing or damaged (negative controls) is refused by name."""
    import shutil

    from safetensors import safe_open

    from megatrain.run import train_state

    folder = Path(runs["folders"]["accelerator"])
    listed = torch.load(folder / train_state.OPTIMIZER_FILE, weights_only=True)
    names = [train_state.ACC_SHARD.format(r) for r in range(2)]
    assert sorted(listed["shards"]) == names
    held = []
    for name in names:
        with safe_open(str(folder / name), "pt") as f:
            held.append(set(f.keys()))
    assert held[0] and held[1] and not held[0] & held[1]
    wanted = {f"optim.{i}.{k}" for i, e in listed["optimizer"]["state"].items() for k, v in e.items()
              if v == "__in_tensors__"}
    assert wanted == held[0] | held[1]  # every state tensor, each once, in the shard of the rank that owns it
    example = runs["example"]
    for damage in ("missing", "truncated"):
        copy = tmp_path / damage
        shutil.copytree(folder, copy)
        if damage == "missing":
            (copy / names[1]).unlink()
        else:
            with open(copy / names[1], "r+b") as f:
                f.truncate((copy / names[1]).stat().st_size - 8)
        with pytest.raises(Exception, match=names[1]):
            example.train("accelerator", GLOBAL_MICRO, 1, 0, steps=TOTAL_STEPS, resume_from=copy)


@pytest.mark.slow
def test_a_rank_killed_mid_shard_leaves_the_previous_checkpoint_the_one_that_loads(tmp_path: Path) -> None:
    """Two ranks sharing one host store save checkpoint "a", train on, and save "b"; rank 1 is SIGKILLed while
    writing its shard of "b". Rank 0's save fails (its peer is gone) and publishes nothing: "a" is still the
    newest checkpoint, and it loads in one process with the weights it was saved with."""
    from megatrain.run import checkpoint as ck

    ranks = Ranks(2, [str(ROOT / "tests" / "workers" / "dp_kill_worker.py"), str(tmp_path)], tmp_path)
    codes = ranks.wait()
    assert codes == [3, -9], (codes, ranks.log(0)[-3000:], ranks.log(1)[-3000:])
    assert (tmp_path / "b_error.txt").is_file() and not (tmp_path / "b_saved.txt").exists()
    root = tmp_path / "ckpt"
    assert [tag for _, tag in ck.list_checkpoints(root)] == ["a"] and ck.latest_tag(root) == "a"
    import megatrain

    example = load_example("train_data_parallel")
    model = example.build_model(seed=5)
    engine, _, _, _ = megatrain.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": example.LR}},
        "megatrain": example.engine_section(30.0)})
    path, _ = engine.load_checkpoint(root)
    assert Path(path).name == "a"
    saved = torch.load(tmp_path / "a.pt")
    assert all(torch.equal(saved[k], v) for k, v in engine.state_dict().items())
    assert engine.global_steps == 1
