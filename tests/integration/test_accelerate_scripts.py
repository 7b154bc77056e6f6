"""Accelerate's own scripts, unchanged: `megatrain.Accelerator` is an `accelerate.Accelerator`.

tests/workers/accelerate_clm_script.py is a causal-LM fine-tuning script in accelerate's example style. With its
one switch (`--megatrain`: `from megatrain import Accelerator`, `backend="megatrain"`) it must train as the same
script on plain accelerate does, under `python` and under `torchrun --nproc-per-node 2` (OMP_NUM_THREADS=1):
every micro-batch's loss within 1e-5, the learning rate identical after every optimizer step, the same batches on
each rank, the same perplexity, a final `save_pretrained` that reloads to the engine's weights, and a resume from
step 10 equal to plain accelerate's resume. Plain accelerate runs the CPU processes as one job
(`ACCELERATE_USE_CPU`, what `accelerate launch --cpu` sets): without it, accelerate on a machine without an
accelerator runs each torchrun process as a job of its own.
"""

from __future__ import annotations

import inspect
import json
import math
import statistics
import subprocess
from collections.abc import Callable
from pathlib import Path

import accelerate
import pytest
import torch
from conftest import tiny_model
from kit import ROOT, finish, free_port, probes, start_python, worker_env

from megatrain import Accelerator
from megatrain.accelerate import REFUSED_ARGUMENTS, REFUSED_ENVIRONMENT, REFUSED_METHODS

SCRIPT = ROOT / "tests" / "workers" / "accelerate_clm_script.py"
STEPS, RESUME_AT, TOL = 30, 10, 1e-5

# accelerate.Accelerator's public attributes that megatrain.Accelerator defines itself, and why; every other public
# attribute must be accelerate's own object (inherited), or refused by name (megatrain/accelerate/refusals.py).
OVERRIDDEN = {
    "prepare": "the model and its optimizer go to the backend together",
    "prepare_model": "the backend's model (for megatrain the user's model object, run by the engine)",
    "prepare_optimizer": "accelerate's AcceleratedOptimizer whose step is the backend's",
    "prepare_scheduler": "points a scheduler at the optimizer the backend steps, then accelerate's",
    "prepare_data_loader": "accelerate's loader, its batches left on the host for the megatrain engine",
    "backward": "the backend's backward (accelerate's loss scaling by the accumulation steps)",
    "unscale_gradients": "the backend scales its own gradients",
    "clip_grad_norm_": "the backend clips (the gradients live in its host slabs)",
    "clip_grad_value_": "the backend clamps",
    "no_sync": "tells the backend's backward not to average across ranks",
    "autocast": "bf16 autocast only for a backend that needs it (megatrain casts inside its forward)",
    "gradient_accumulation_steps": "refused where DeepSpeed fixes the steps (zero3)",
    "unwrap_model": "the backend's model unwrapped to the user's",
    "get_state_dict": "the backend's weights, whole",
    "save_model": "a Hugging Face checkpoint written by the backend",
    "save_state": "accelerate's save_state, the weights and optimizer state written by the backend",
    "load_state": "accelerate's load_state, the weights and optimizer state read by the backend",
    "free_memory": "the backend's engine released too",
    "clear": "free_memory",
}


def test_it_is_an_accelerate_accelerator():
    acc = Accelerator(backend="megatrain")
    assert isinstance(acc, accelerate.Accelerator)
    assert acc.state.__dict__ is accelerate.state.AcceleratorState._shared_state  # accelerate's one state
    assert accelerate.PartialState().num_processes == acc.num_processes == 1
    accelerate.logging.get_logger(__name__).info("accelerate's logger works: the state exists")


def test_every_public_attribute_is_accelerates_or_named():
    """The two classes' public attributes: each of accelerate's is inherited unchanged, overridden for the backend
    (OVERRIDDEN says why) or refused by name; an instance holds every instance attribute accelerate's holds."""
    ours, theirs = Accelerator, accelerate.Accelerator
    public = [n for n in dir(theirs) if not n.startswith("_")]
    assert len(public) > 80  # control: the walk sees accelerate's API
    unexplained = []
    for name in public:
        assert hasattr(ours, name), name
        if inspect.getattr_static(ours, name) is inspect.getattr_static(theirs, name):
            continue
        if name not in OVERRIDDEN and name not in REFUSED_METHODS:
            unexplained.append(name)
    assert unexplained == []
    assert set(OVERRIDDEN) | set(REFUSED_METHODS) <= set(public)  # no stale entries
    mine = Accelerator(backend="megatrain")
    plain = theirs()
    assert {n for n in vars(plain) if not n.startswith("_")} - set(vars(mine)) == set()


def test_what_cannot_apply_is_refused_by_name(monkeypatch):
    acc = Accelerator(backend="megatrain")
    for name in REFUSED_METHODS:
        method = getattr(acc, name)
        with pytest.raises(RuntimeError, match=f"{name}\\(\\) cannot apply"):
            params = [p for p in inspect.signature(method).parameters.values() if p.default is inspect.Parameter.empty]
            ctx = method(*[None] * len(params))
            if hasattr(ctx, "__enter__"):
                with ctx:
                    pass
    for name in REFUSED_ARGUMENTS:
        with pytest.raises(ValueError, match=f"does not take {name}="):
            Accelerator(backend="megatrain", **{name: object()})
    for var in REFUSED_ENVIRONMENT:
        monkeypatch.setenv(var, "true")
        with pytest.raises(ValueError, match=var):
            Accelerator(backend="megatrain")
        monkeypatch.delenv(var)


def test_prepare_keeps_frozen_parameters_frozen():
    model = tiny_model()
    model.model.embed_tokens.weight.requires_grad_(False)
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    acc = Accelerator(backend="megatrain")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model, _ = acc.prepare(model, opt)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == before


# -- the script, on the face and on plain accelerate ----------------------------------------------------------------

def _start(out: Path, ranks: int, *extra: str, accelerate_launch: Path | None = None,
           megatrain_launch: bool = False) -> tuple[subprocess.Popen, Path, int]:
    """The script started in `ranks` processes (torchrun; `accelerate launch --config_file` when given;
    `megatrain launch`), its output to a file beside `out` (a run started beside another never blocks on a full
    pipe)."""
    args = [SCRIPT, "--output_dir", out, "--report", out / "report", "--max_train_steps", str(STEPS),
            "--checkpointing_steps", str(RESUME_AT), *extra]
    if megatrain_launch:
        args = ["-m", "megatrain.commands.cli", "launch", "--nproc-per-node", str(ranks), "--master-port",
                str(free_port()), *args]
    elif accelerate_launch is not None:
        args = ["-m", "accelerate.commands.launch", "--config_file", accelerate_launch,
                "--main_process_port", str(free_port()), *args]
    elif ranks > 1:
        args = ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port", str(free_port()),
                *args]
    # accelerate launch sets ACCELERATE_USE_CPU from its config's use_cpu (set beforehand, it takes the launch off
    # the DeepSpeed road)
    cpu = {} if accelerate_launch is not None else {"ACCELERATE_USE_CPU": "true"}
    out.parent.mkdir(parents=True, exist_ok=True)
    return start_python(args, env=worker_env(threads=1, **cpu), log=out.with_suffix(".log")), out, ranks


def _collect(run: tuple[subprocess.Popen, Path, int]) -> list[dict]:
    """A started run to its end; each rank's report."""
    proc, out, ranks = run
    finish(proc, timeout=900, log=out.with_suffix(".log"))
    reports = [json.loads((out / "report" / f"report_rank{r}.json").read_text()) for r in range(ranks)]
    assert all(r["num_processes"] == ranks for r in reports)
    return reports


def _launch(out: Path, ranks: int, *extra: str, accelerate_launch: Path | None = None) -> list[dict]:
    """The script to its end (as `_start` starts it); each rank's report."""
    return _collect(_start(out, ranks, *extra, accelerate_launch=accelerate_launch))


def _beside(run: tuple[subprocess.Popen, Path, int], work: Callable[[], list[dict]]) -> tuple[list[dict], list[dict]]:
    """`work()` here while `run` trains (the two read none of each other's files: on two cores each start-up,
    single-threaded, takes a core of its own), then `run`'s reports; `run` killed if `work` fails."""
    try:
        done = work()
    except BaseException:
        run[0].kill()
        raise
    return done, _collect(run)


def _resumed(root: Path, name: str, ranks: int, flags: list[str],
             launch: Path | None = None) -> tuple[subprocess.Popen, Path, int]:
    """The run in root/`name` started again from its step-RESUME_AT state, into root/`name`_resumed."""
    return _start(root / (name + "_resumed"), ranks, *flags, "--resume_from_checkpoint",
                  str(root / name / f"step_{RESUME_AT}"), accelerate_launch=launch)


class _PlainRuns:
    """Plain accelerate's runs of the script (python or torchrun, ACCELERATE_USE_CPU), each made once per module:
    every face below is compared with the same plain run of its rank count (the same arguments, so the same
    losses, learning rates, batches and saved model), which each test used to launch again for itself."""

    def __init__(self, root: Path) -> None:
        self.root, self.done = root, {}

    def dir(self, ranks: int) -> Path:
        return self.root / f"ranks{ranks}" / "plain"

    def full(self, ranks: int) -> list[dict]:
        if ranks not in self.done:
            self.done[ranks] = _launch(self.dir(ranks), ranks)
        return self.done[ranks]

    def resumed(self, ranks: int) -> list[dict]:
        key = (ranks, "resumed")
        if key not in self.done:
            self.full(ranks)
            self.done[key] = _collect(_resumed(self.dir(ranks).parent, "plain", ranks, []))
        return self.done[key]


@pytest.fixture(scope="module")
def plain_runs(tmp_path_factory) -> _PlainRuns:
    return _PlainRuns(tmp_path_factory.mktemp("plain_accelerate"))


def _runs(root: Path, plain: _PlainRuns, ranks: int, face: list[str],
          launch: Path | None = None) -> dict[str, list[dict]]:
    """Plain accelerate and the face, each trained STEPS steps and resumed from its step-RESUME_AT state (the
    face's runs beside plain accelerate's where those are not made yet)."""
    runs = {}
    runs["plain"], runs["face"] = _beside(_start(root / "face", ranks, *face, accelerate_launch=launch),
                                          lambda: plain.full(ranks))
    runs["plain_resumed"], runs["face_resumed"] = _beside(_resumed(root, "face", ranks, face, launch),
                                                          lambda: plain.resumed(ranks))
    return runs


def _assert_same_training(plain: list[dict], face: list[dict], steps: int, what: str) -> None:
    for rank, (p, f) in enumerate(zip(plain, face)):
        assert len(p["losses"]) == len(f["losses"]) == steps * 2  # 2 micro-batches a step
        gap = max(abs(a - b) for a, b in zip(p["losses"], f["losses"]))
        print(f"{what} rank {rank}: losses max diff {gap:.2g}, perplexity {f['perplexity']:.5f} (face) vs "
              f"{p['perplexity']:.5f} (accelerate)")
        assert gap <= TOL
        assert p["lrs"] == f["lrs"] and len(p["lrs"]) == steps  # accelerate's scheduler, stepped as accelerate does
        assert p["batches"] == f["batches"]  # the same batches on this rank
        assert math.isclose(p["perplexity"], f["perplexity"], rel_tol=TOL)
        # Control: the losses move from one micro-batch to the next by far more than the tolerance.
        assert statistics.median(abs(a - b) for a, b in zip(p["losses"], p["losses"][1:])) > 100 * TOL
    if len(plain) > 1:
        assert plain[0]["batches"] != plain[1]["batches"]  # control: the ranks get different shards


def _assert_saved_model_is_the_engines(root: Path, plain_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(root / "face").state_dict()
    engine = torch.load(root / "face" / "report" / "final_weights.pt")
    assert set(engine) <= set(saved)
    assert all(torch.equal(saved[n], engine[n]) for n in engine)
    plain = AutoModelForCausalLM.from_pretrained(plain_dir).state_dict()
    gap = max((saved[n] - plain[n]).abs().max().item() for n in engine)
    print(f"saved model: reloads bit-identical to the engine's weights, {gap:.2g} from plain accelerate's")
    assert gap <= TOL


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_accelerate_script_on_the_face_trains_as_on_accelerate(tmp_path, plain_runs, ranks):
    runs = _runs(tmp_path, plain_runs, ranks, ["--megatrain"])
    _assert_same_training(runs["plain"], runs["face"], STEPS, f"{ranks} ranks")
    assert all(r["unwrapped"] == "LlamaForCausalLM" and r["accelerator"] == "megatrain.accelerate.accelerator"
               for r in runs["face"])
    _assert_saved_model_is_the_engines(tmp_path, plain_runs.dir(ranks))
    # Resumed from step 10: as plain accelerate's resume, the schedule carried on from where it was saved.
    assert all(r["start_step"] == RESUME_AT for r in runs["face_resumed"])
    _assert_same_training(runs["plain_resumed"], runs["face_resumed"], STEPS - RESUME_AT, f"{ranks} ranks resumed")
    assert runs["face_resumed"][0]["lrs"] == runs["face"][0]["lrs"][RESUME_AT:]


@pytest.mark.slow
def test_accelerate_script_on_the_face_under_megatrain_launch(tmp_path, plain_runs):
    """`megatrain launch --nproc-per-node 2` starts the ranks through its routing bootstrap: the face trains there
    as under torchrun, against plain accelerate under torchrun."""
    plain, face = _beside(_start(tmp_path / "face", 2, "--megatrain", megatrain_launch=True),
                          lambda: plain_runs.full(2))
    _assert_same_training(plain, face, STEPS, "megatrain launch, 2 ranks")
    _assert_saved_model_is_the_engines(tmp_path, plain_runs.dir(2))


DS_CONFIG = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
             "train_batch_size": "auto", "gradient_clipping": 0.0, "zero_optimization": {"stage": 2}, "megatrain": {}}


def _ds_launch_config(root: Path, ranks: int, ds_config: dict) -> Path:
    """An `accelerate launch` config for accelerate's DeepSpeed road on this machine's CPU, `ranks` processes."""
    (root / "ds.json").write_text(json.dumps(ds_config))
    launch = root / "ds.yaml"
    launch.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\ndeepspeed_config:\n"
                      f"  deepspeed_config_file: {root / 'ds.json'}\n  zero3_init_flag: false\n"
                      f"machine_rank: 0\nnum_machines: 1\nnum_processes: {ranks}\nuse_cpu: true\n")
    return launch


STATE_PROBE = """
import json, sys
import torch.distributed as dist
from accelerate import Accelerator
acc = Accelerator(gradient_accumulation_steps=2)
print("PROBE " + json.dumps({"num_processes": acc.num_processes, "process_index": acc.process_index,
                             "distributed_type": str(acc.distributed_type), "group": dist.get_world_size(),
                             "backend": acc.state.backend}), flush=True)
"""


class _RoadRuns:
    """The script unchanged under `accelerate launch` on the DeepSpeed road with a "megatrain" section, trained and
    resumed beside plain accelerate (`_runs`), once per rank count for the module: the road's test of that rank
    count reads them, and the state test reads the state the script's accelerator was made with (the same
    `Accelerator(gradient_accumulation_steps=2)` on the same launch as a probe of its own, which was a launch more)."""

    def __init__(self, factory: pytest.TempPathFactory, plain: _PlainRuns) -> None:
        self.factory, self.plain, self.done = factory, plain, {}

    def get(self, ranks: int) -> tuple[Path, dict[str, list[dict]]]:
        """(where the runs wrote, the runs) of `ranks` processes."""
        if ranks not in self.done:
            root = self.factory.mktemp(f"road{ranks}")
            self.done[ranks] = root, _runs(root, self.plain, ranks, [], launch=_ds_launch_config(root, ranks,
                                                                                                 DS_CONFIG))
        return self.done[ranks]


@pytest.fixture(scope="module")
def road_runs(tmp_path_factory, plain_runs) -> _RoadRuns:
    return _RoadRuns(tmp_path_factory, plain_runs)


@pytest.fixture(scope="module")
def road_states(tmp_path_factory, road_runs) -> dict[bool, list[dict]]:
    """Each rank's accelerate state on the DeepSpeed road, 2 ranks under `accelerate launch`: with a "megatrain"
    section (True) as the script's run there made it, and without (False) as the state probe printed it."""
    root = tmp_path_factory.mktemp("road_section_False")
    launch = _ds_launch_config(root, 2, {k: v for k, v in DS_CONFIG.items() if k != "megatrain"})
    (root / "probe.py").write_text(STATE_PROBE)
    log = root / "launch.log"
    proc = start_python(["-m", "accelerate.commands.launch", "--config_file", launch, "--main_process_port",
                         str(free_port()), root / "probe.py"], env=worker_env(threads=1), log=log)
    try:
        _, runs = road_runs.get(2)  # the script's runs meanwhile (they read nothing the probe writes)
    except BaseException:
        proc.kill()
        raise
    finish(proc, timeout=300, log=log)
    return {True: [r["state"] for r in runs["face"]],
            False: sorted(probes(log.read_text()), key=lambda s: s["process_index"])}


@pytest.mark.parametrize("section", [True, False])
def test_deepspeed_road_on_cpu_counts_every_rank(road_states, section):
    """On a machine without an accelerator, accelerate's DeepSpeed road makes a process group of every rank
    (DeepSpeed's init_distributed) but, finding no device backend, records one process: accelerate then filled
    train_batch_size for one rank and MegaTrain's parser (counting the group's) refused it, and each rank read
    itself as rank 0 (its loader not sharded). With a "megatrain" section the state counts the group's ranks; without one (real DeepSpeed) it is
    left as accelerate makes it, the control that this launch does meet accelerate's one-process record."""
    states = road_states[section]
    assert len(states) == 2 and all(s["group"] == 2 and s["distributed_type"] == "DistributedType.DEEPSPEED"
                                    for s in states), states
    if section:
        assert [(s["num_processes"], s["process_index"], s["backend"]) for s in states] == [(2, 0, "gloo"),
                                                                                             (2, 1, "gloo")]
    else:
        assert [(s["num_processes"], s["backend"]) for s in states] == [(1, None), (1, None)]


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_accelerate_script_unchanged_on_the_deepspeed_road(road_runs, plain_runs, ranks):
    """The same script without its switch, under `accelerate launch` with a DeepSpeed config whose "megatrain"
    section puts MegaTrain behind accelerate's DeepSpeed road, against plain accelerate (no clipping on either:
    the config says gradient_clipping 0)."""
    tmp_path, runs = road_runs.get(ranks)
    # accelerate's DeepSpeed road, with MegaTrain's engine behind it (DeepSpeed's own engine would say so)
    assert all(r["distributed_type"] == "DistributedType.DEEPSPEED" and r["prepared"] == "MegaTrainEngine"
               for r in runs["face"]), [(r["distributed_type"], r["prepared"]) for r in runs["face"]]
    _assert_same_training(runs["plain"], runs["face"], STEPS, f"DeepSpeed road, {ranks} ranks")
    assert all(r["unwrapped"] == "LlamaForCausalLM" for r in runs["face"])
    _assert_saved_model_is_the_engines(tmp_path, plain_runs.dir(ranks))
    # Resumed from step 10: the schedule carries on from where it was saved, as plain accelerate's resume (issue 61
    # saw real DeepSpeed's resume keep the learning rate where load_state left it).
    assert all(r["start_step"] == RESUME_AT for r in runs["face_resumed"])
    _assert_same_training(runs["plain_resumed"], runs["face_resumed"], STEPS - RESUME_AT,
                          f"DeepSpeed road, {ranks} ranks resumed")
    assert all(res["lrs"] == full["lrs"][RESUME_AT:] for res, full in zip(runs["face_resumed"], runs["face"]))
