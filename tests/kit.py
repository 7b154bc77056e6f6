"""The test kit: what many tests need, written once (import it as `from kit import ...`)."""

from __future__ import annotations

import dataclasses
import itertools
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

if TYPE_CHECKING:
    from megatrain.engine import Engine


def engine_factory(residency: Any = "stream", engines: list | None = None, **extra: Any) -> Callable[..., Engine]:
    """An engine factory for the parity probe (`run_probe(cls, config, factory)`) that trains with `residency` and
    the settings in `extra` over the probe's own, keeping each engine it makes in `engines` (when given)."""
    from megatrain.engine import Engine

    def make(model, cfg, optimizer=None) -> Engine:
        eng = Engine(model, dataclasses.replace(cfg, residency=residency, **extra), optimizer=optimizer)
        if engines is not None:
            engines.append(eng)
        return eng
    return make


def kept_graphs(engines: list) -> int:
    """How many layers kept their forward graph in the last training step of the last engine made."""
    return int(engines[-1].pipeline.residency_stats()["kept_graph_layers"])


# -- the worker launcher: every Python process a test starts ------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
# What a launcher (torchrun, accelerate, deepspeed) sets: a process a test starts is a lone process unless the test
# says otherwise, whatever this process was started with or an earlier test left in os.environ.
LAUNCHER_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE")
# The tail of a failed process's output a test's message carries: enough for a traceback, short enough to read.
TAIL_CHARS = 5000


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS's pick: processes started side by side never share one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_env(*, world_size: int | None = None, rank: int = 0, local_rank: int | None = None,
               port: int | None = None, threads: int | None = None, path: Sequence[str | Path] = (),
               drop: Sequence[str] = (), **extra: str) -> dict[str, str]:
    """The environment of a Python process a test starts, from this one's: no launcher variable (a lone process)
    unless `world_size` is given, then rank `rank` (LOCAL_RANK `local_rank`, else `rank`) of a job meeting at
    127.0.0.1:`port` (a free port unless given); PYTHONPATH `path` then this checkout (so a worktree's processes
    import its own code, never an editable install's); this interpreter's bin first on PATH (DeepSpeed's op builder
    runs the venv's ninja); OMP_NUM_THREADS `threads` when given; the variables in `drop` left out; `extra` set."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and k not in drop}
    env["PYTHONPATH"] = os.pathsep.join([*map(str, path), str(ROOT)])
    bin_dir = os.path.dirname(sys.executable)
    env["PATH"] = os.pathsep.join([bin_dir, *(p for p in env.get("PATH", "").split(os.pathsep) if p and p != bin_dir)])
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    if world_size is not None:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port if port is not None else free_port()),
                   RANK=str(rank), WORLD_SIZE=str(world_size),
                   LOCAL_RANK=str(rank if local_rank is None else local_rank))
    env.update(extra)
    return env


def _argv(args: Sequence[str | Path]) -> list[str]:
    return [sys.executable, *map(str, args)]


def run_python(args: Sequence[str | Path], *, env: dict[str, str] | None = None, cwd: str | Path = ROOT,
               timeout: float = 600, check: bool = False, **popen: Any) -> subprocess.CompletedProcess:
    """This interpreter with `args` (a script and its arguments, `-m module ...` or `-c code ...`) in `env`
    (`worker_env()` unless given), run to its end within `timeout` seconds; its stdout and stderr captured as
    text. `check`: the test fails on a nonzero exit, its message the tails of both outputs."""
    popen.setdefault("capture_output", True)
    popen.setdefault("text", True)
    r = subprocess.run(_argv(args), cwd=cwd, env=worker_env() if env is None else env, timeout=timeout, **popen)
    if check and r.returncode != 0:
        pytest.fail(f"{' '.join(map(str, args))[:300]} exited with {r.returncode}\n"
                    f"--- stdout (tail)\n{str(r.stdout)[-TAIL_CHARS:]}\n--- stderr (tail)\n{str(r.stderr)[-TAIL_CHARS:]}")
    return r


def start_python(args: Sequence[str | Path], *, env: dict[str, str] | None = None, cwd: str | Path = ROOT,
                 log: str | Path | None = None, **popen: Any) -> subprocess.Popen:
    """This interpreter with `args` started in `env` (`worker_env()` unless given), left running. `log`: its
    stdout and stderr both go to that file (a process left running beside another never blocks on a full pipe
    nobody reads yet); otherwise `popen` says where they go (subprocess.Popen's own arguments)."""
    env = worker_env() if env is None else env
    if log is None:
        return subprocess.Popen(_argv(args), cwd=cwd, env=env, **popen)
    popen.setdefault("text", True)
    with open(log, "w") as f:
        return subprocess.Popen(_argv(args), cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, **popen)


# -- the engine builder ---------------------------------------------------------------------------------------------

def bf16_engine(model: torch.nn.Module, *, lr: float = 1e-2, **cfg: Any) -> Engine:
    """An engine on a copy of `model` as the host-mode comparisons build it: bf16 compute, the loss in chunks of
    13 tokens (no chunk boundary on a sequence's edge) unless `cfg` says otherwise, a fused AdamW at `lr` (1e-2:
    large enough that every step moves the low bits of every master); `cfg` the rest of its EngineConfig."""
    import copy

    from megatrain.config.schema import EngineConfig
    from megatrain.engine import Engine

    cfg.setdefault("loss_chunk_tokens", 13)
    return Engine(copy.deepcopy(model), EngineConfig(compute_dtype="bfloat16", **cfg),
                  optimizer=lambda named: torch.optim.AdamW([p for _, p in named], lr=lr, fused=True))


def cpu_engine(layers: int = 2, **cfg: Any) -> Engine:
    """An engine on the CPU device over a fresh tiny Llama of `layers` layers (conftest's, seeded), the parity probe
    off (the test is not about it); `cfg` the rest of its EngineConfig."""
    from conftest import tiny_model

    from megatrain.config.schema import EngineConfig
    from megatrain.engine import Engine

    return Engine(tiny_model("llama", layers=layers), EngineConfig(device="cpu", parity_probe=False, **cfg))


def bits(t: torch.Tensor) -> torch.Tensor:
    """A float tensor's bit patterns as integers of its width (FP32 as int32, bf16 / fp16 as int16): equal only where
    every bit is, where float equality would take -0.0 for 0.0 and never a NaN for itself."""
    return t.view({4: torch.int32, 2: torch.int16, 8: torch.int64}[t.element_size()])


def wide_range(n: int, seed: int, spread: float = 3.0) -> torch.Tensor:
    """`n` FP32 values from generator `seed`, normal times e^(normal x `spread`): magnitudes over many binades, so a
    sum or norm taken in another order, or a kernel rounding otherwise, gives other bits."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * spread)


def same_run(a: tuple[list, dict[str, torch.Tensor]], b: tuple[list, dict[str, torch.Tensor]]) -> bool:
    """Two runs' (per-step figures, final state dict): the figures equal exactly, every tensor of `a`'s state equal
    to `b`'s of its name."""
    return a[0] == b[0] and all(torch.equal(v, b[1][k]) for k, v in a[1].items())


def fresh_accelerate_state() -> None:
    """A new accelerate state: AcceleratorState (with PartialState) and GradientState are one per process, and a
    second Accelerator with another mixed precision or accumulation plugin would meet the first's (accelerate raises
    "already been initialized"); accelerate's own tests reset them between Accelerators the same way."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


# -- the reference trainer: the loop every training comparison runs ------------------------------------------------

def train_steps(runner: Any, batches: Iterable[dict], steps: int, *, accum: int = 1, clip: float | None = None,
                scheduler: Any = None, start: int = 0,
                after_backward: Callable[[Any], None] | None = None,
                before_clip: Callable[[Any, int], None] | None = None) -> tuple[list[float], list[float]]:
    """`steps` optimizer steps of `runner` (an Engine, or anything with its training calls) on `batches` from step
    `start`, `accum` micro-batches each (each loss divided by `accum` before its backward), clipped to `clip`
    when given, `scheduler` stepped after each step: (each micro-batch's loss, each step's pre-clip norm).
    `after_backward(runner)` runs after each micro-batch's backward, `before_clip(runner, step)` after each
    step's last one."""
    losses, norms = [], []
    it = itertools.islice(batches, start * accum, None)
    for s in range(steps):
        for _ in range(accum):
            loss = runner(**next(it)).loss
            runner.backward(loss / accum)
            losses.append(loss.item())
            if after_backward is not None:
                after_backward(runner)
        if before_clip is not None:
            before_clip(runner, s)
        if clip:
            norms.append(runner.clip_grad_norm_(clip))
        runner.step()
        runner.zero_grad()
        if scheduler is not None:
            scheduler.step()
    return losses, norms


def model_steps(engine: Engine, model: torch.nn.Module, batches: Iterable[dict]) -> tuple[list[float], dict]:
    """One optimizer step per batch through the model object the engine trains (the user's own call), its stats
    reset before each: (each step's loss, the last step's `collect_stats()`)."""
    losses = []
    for b in batches:
        engine.reset_stats()
        loss = model(**b).loss
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    return losses, engine.collect_stats()


def assert_trains_like_sgd(ref: torch.nn.Module, config: Any, batches: Iterable[dict], lr: float = 0.05,
                           tol: float = 1e-5) -> None:
    """An engine built with `config` on a copy of `ref` and `ref` itself, each trained by SGD(`lr`) on `batches`
    side by side: every step's loss within `tol` of PyTorch's."""
    import copy

    from megatrain.engine import Engine

    mine = copy.deepcopy(ref)
    engine = Engine(mine, config, optimizer=torch.optim.SGD(mine.parameters(), lr=lr))
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    for batch in batches:
        ref_loss = ref(**batch).loss
        ref_loss.backward()
        opt.step()
        opt.zero_grad()
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        assert abs(loss.item() - ref_loss.item()) <= tol


def finish(proc: subprocess.Popen, *, timeout: float = 600, log: str | Path | None = None) -> None:
    """Waits up to `timeout` seconds for `proc` (from `start_python`), killing it on the way out whatever happened
    (a test that failed leaves no process behind); the test fails on a nonzero exit, with the tail of `log` (the
    file its output went to)."""
    try:
        proc.wait(timeout=timeout)
    finally:
        proc.kill()
    if proc.returncode != 0:
        tail = Path(log).read_text()[-TAIL_CHARS:] if log is not None else "(not kept)"
        pytest.fail(f"{' '.join(map(str, proc.args[1:]))[:300]} exited with {proc.returncode}\n"
                    f"--- output (tail)\n{tail}")



def layer_numel(state: dict) -> int:
    """Elements of the first decoder layer in a worker's state dict (every layer of the test models is as big)."""
    return sum(v.numel() for k, v in state.items() if ".layers.0." in k)


def parity_gaps(ref: dict, got: dict) -> dict[str, float]:
    """The largest differences of a data-parallel run `got` from the one-process reference `ref` (each a worker's
    results: "losses", "norms", "state"): losses, relative pre-clip norms, and the weights `got` holds (a rank of
    nodes sharing one store holds its own layers and the resident parameters)."""
    return {"losses": max(abs(a - b) for a, b in zip(ref["losses"], got["losses"], strict=True)),
            "norms": max(abs(a - b) / a for a, b in zip(ref["norms"], got["norms"], strict=True)),
            "params": max((ref["state"][k] - v).abs().max().item() for k, v in got["state"].items())}


def ranks_beside_one_process(worker: str | Path, tmp_path: Path, args: dict, runs: list[str],
                             deadline_s: float = 600, reference: dict | None = None) -> tuple[dict, list[dict]]:
    """`args["world"]` ranks of `worker` under torchrun (its runs `runs`, each rank writing rank{r}.pt under
    `tmp_path`) and, while they run, the one-process reference on the concatenated batch (its "per_rank" run at
    micro-batch x world, every layer streamed) unless `reference` is that, made already: (the reference, each
    rank's results)."""
    import json

    env = worker_env(threads=1, PYTHONWARNINGS="ignore")
    log = tmp_path / "torchrun.log"
    with open(log, "w") as f:
        proc = start_python(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args["world"]),
                             worker, tmp_path, json.dumps({**args, "runs": runs})], env=env, stdout=f,
                            stderr=subprocess.STDOUT, text=True)
    try:
        if reference is None:
            lone = tmp_path / "lone"
            lone.mkdir()
            whole = {**args, "micro": args["micro"] * args["world"], "world": 1, "runs": ["per_rank"]}
            run_python([worker, lone, json.dumps(whole)], env=env, timeout=deadline_s, check=True)
            reference = torch.load(lone / "rank0.pt")["per_rank"]
    except BaseException:
        proc.kill()
        raise
    finish(proc, timeout=deadline_s, log=log)
    return reference, [torch.load(tmp_path / f"rank{r}.pt") for r in range(args["world"])]


class NodeLaunches:
    """The node path's launches, each made once per session and read by tests/integration/test_node_path.py and
    test_node_residency.py (tests/workers/node_residency_worker.py runs both modules' runs): 2 ranks x micro-batch 2
    with every run either module reads, 4 ranks x micro-batch 1, and the one-process reference at micro-batch 4 that
    both compare with (the same global batch, steps and layers: one reference, made beside the first launch)."""

    WORKER = ROOT / "tests" / "workers" / "node_residency_worker.py"
    ARGS = {"micro": 2, "world": 2, "steps": 3, "layers": 4}

    def __init__(self, factory: pytest.TempPathFactory, deadline_s: float = 600) -> None:
        self.factory, self.deadline_s = factory, deadline_s
        self.reference: dict | None = None
        self.launched: dict[int, list[dict]] = {}

    def _launch(self, world: int, runs: list[str]) -> tuple[dict, list[dict]]:
        if world not in self.launched:
            args = {**self.ARGS, "micro": self.ARGS["micro"] * self.ARGS["world"] // world, "world": world}
            self.reference, self.launched[world] = ranks_beside_one_process(
                self.WORKER, self.factory.mktemp(f"node{world}"), args, runs, self.deadline_s, self.reference)
        return self.reference, self.launched[world]

    def two(self) -> tuple[dict, list[dict]]:
        """(the reference, each of 2 ranks' results): test_node_path's runs and test_node_residency's."""
        from test_node_path import RUNS as path_runs
        from test_node_residency import RUNS as residency_runs

        return self._launch(2, list(dict.fromkeys(path_runs + residency_runs)))

    def four(self) -> tuple[dict, list[dict]]:
        """(the reference, each of 4 ranks' results): every layer streamed ("node") and the first 2 kept ("node:k2")."""
        return self._launch(4, ["node", "node:k2"])


def probes(out: str) -> list[dict]:
    """Every `PROBE {json}` a worker printed. Ranks share a launcher's stdout, and one rank's line can follow the
    other's with no newline between (seen once: two objects on one line), so each object is read from where it
    starts."""
    import json

    decode, found, at = json.JSONDecoder().raw_decode, [], out.find("PROBE ")
    while at >= 0:
        obj, end = decode(out, at + len("PROBE "))
        found.append(obj)
        at = out.find("PROBE ", end)
    return found


def adamw_engine(model: torch.nn.Module, config: Any) -> tuple[Engine, torch.optim.lr_scheduler.LRScheduler]:
    """An engine over `model` with AdamW (lr 1e-2, weight decay 0.01) and a LambdaLR decaying as 1 / (1 + step)."""
    from megatrain.engine import Engine

    eng = Engine(model, config, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01))
    return eng, torch.optim.lr_scheduler.LambdaLR(eng.optimizer, lambda s: 1.0 / (1 + s))


def adam_state(engine: Engine, params: Iterable[torch.nn.Parameter] | None = None) -> list[torch.Tensor]:
    """Each parameter's (of `params`, else all the optimizer's) Adam step, m and v, as CPU copies, after the
    engine's pending work."""
    engine.synchronize()
    ids = None if params is None else {id(p) for p in params}
    out = []
    for g in engine.optimizer.param_groups:
        for p in g["params"]:
            if ids is None or id(p) in ids:
                st = engine.optimizer.state[p]
                out += [st[key].detach().to("cpu", copy=True) for key in ("step", "exp_avg", "exp_avg_sq")]
    return out


def router_loss_moe() -> torch.nn.Module:
    """A 3-layer Mixtral whose loss includes its router's auxiliary loss (output_router_logits), seeded."""
    import transformers

    cfg = transformers.AutoConfig.for_model(
        "mixtral", hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
        router_aux_loss_coef=0.1, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def settle_speculation(engine: Engine) -> None:
    """The speculative updates queued so far done (the optimizer thread's queue; Engine.synchronize() would undo
    them)."""
    from megatrain.engine.update.speculative import Speculative

    if isinstance(engine.update, Speculative):
        engine.update.layered.synchronize()


def assert_same_training_state(a: Engine, b: Engine) -> None:
    """The same weights and Adam state, bit for bit (an entry of no state, a parameter not yet stepped, is what the
    per-layer views leave: not state)."""
    sa, sb = a.state_dict(), b.state_dict()
    diff = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert not diff, f"weights differ: {diff}"
    oa, ob = ({k: v for k, v in e.optimizer.state_dict()["state"].items() if v} for e in (a, b))
    assert oa.keys() == ob.keys()
    for k in oa:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(oa[k][name], ob[k][name]), (k, name)


def torchrun_nodes(worker: str | Path, out: Path, args: dict, nodes: int, per_node: int,
                   deadline_s: float = 600) -> list[dict]:
    """`nodes` torchrun agents on this machine (`--nnodes nodes --nproc-per-node per_node`), each rank of `worker`
    writing rank{r}.pt under `out` (made here): each rank's results, in rank order."""
    import json

    import torch

    out.mkdir()
    port = free_port()
    procs = []
    try:
        for node in range(nodes):
            log = out / f"node{node}.log"
            procs.append((start_python(["-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node",
                                        str(per_node), "--node-rank", str(node), "--master-addr", "127.0.0.1",
                                        "--master-port", str(port), worker, out, json.dumps(args)],
                                       env=worker_env(threads=1, PYTHONWARNINGS="ignore"), log=log), log))
        for proc, log in procs:
            finish(proc, timeout=deadline_s, log=log)
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
    return [torch.load(out / f"rank{r}.pt") for r in range(nodes * per_node)]
