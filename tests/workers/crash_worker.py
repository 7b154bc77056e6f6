"""A fork server for tests/integration/test_reliability.py: import once, then fork short training runs to kill.

Importing torch + transformers takes 5-40 s depending on the machine's load; the crash test needs
dozens of processes, each killed with SIGKILL. So this process imports everything and builds the
initial model once, then reads one JSON command per line on stdin and forks a child per command. The
child is a real, separate process: it trains through `megatrain.initialize`, checkpoints with
`save_checkpoint`, and dies however the test decides (SIGKILL from outside, a SIGKILL it sends
itself at a chosen file-system operation inside a checkpoint write, SIGTERM for a graceful stop).

Protocol, one line each on stdout (written with os.write, so lines from the server and its child
never interleave mid-line):
    ready                               the server is up
    pid <pid>                           a child started
    resume <pid> <step>                 the child loaded the checkpoint of global step <step>
    start <pid> <step>                  about to train from global step <step>
    loss <pid> <step> <micro> <hex>     loss of one micro-batch, float.hex (exact)
    step <pid> <n>                      global step n completed (optimizer stepped)
    save-begin <pid> <n> / saved <pid> <n>   around save_checkpoint after step n
    saveops <pid> <n> <kinds>           the file-system operations that save performed (calibration)
    crash <pid> <kind> <k>              about to SIGKILL itself at the k-th <kind> operation of a save
    missed <pid>                        the armed crash point never came (the child exits with 3)
    done <pid>                          trained to the end; final state written
    exit <pid> <wait status>            the server reaped the child
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

import megatrain.run.checkpoint as ckpt  # noqa: E402
from megatrain.deepspeed import initialize  # noqa: E402
from megatrain.run.graceful import GracefulStop  # noqa: E402

VOCAB, SEQ, MICRO, GAS = 128, 16, 2, 2


def ds_config(total_steps: int, megatrain: dict[str, Any] | None = None) -> dict[str, Any]:
    return {**({"megatrain": megatrain} if megatrain else {}),
        "train_batch_size": MICRO * GAS,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-3,
                                                          "warmup_num_steps": 4, "total_num_steps": total_steps}},
    }


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    # Dropout makes the result depend on the RNG stream, so a resume that restored the RNG wrongly
    # (or consumed random numbers while saving) shows up as a different loss.
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                                   attention_dropout=0.1)
    return transformers.LlamaForCausalLM(cfg)


def batch(step: int, micro: int) -> dict[str, torch.Tensor]:
    """The data position is the global step: a resumed run must continue with the batch it would have seen."""
    g = torch.Generator().manual_seed(10_000 + 97 * step + micro)
    ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[1, : SEQ // 4] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def emit(*parts: object) -> None:
    os.write(1, (" ".join(str(p) for p in parts) + "\n").encode())


class SaveProbe:
    """Counts (and optionally dies at, or slows down) the file-system operations of each checkpoint save.

    Operations are observed where `megatrain.run.checkpoint` performs them: each tensor streamed into the
    tensor file, every fsync, rename, replace, unlink and rmtree. `crash` = (save step, kind, k)
    SIGKILLs the process just before the k-th operation of that kind in the save after that step.
    """

    KINDS = ("tensor", "fsync", "rename", "replace", "unlink", "rmtree")

    def __init__(self, crash: list | None, slow_ms: float) -> None:
        self.crash = tuple(crash) if crash else None
        self.slow_s = slow_ms / 1000
        self.active_step: int | None = None
        self.ops: list[str] = []
        self.counts: dict[str, int] = {}
        self._install()

    def _op(self, kind: str) -> None:
        if self.active_step is None:
            return
        self.ops.append(kind)
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if self.crash is not None and self.crash == (self.active_step, kind, self.counts[kind]):
            emit("crash", os.getpid(), kind, self.counts[kind])
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "tensor" and self.slow_s:
            time.sleep(self.slow_s)

    def _wrap(self, owner: Any, name: str, kind: str) -> None:
        real = getattr(owner, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self._op(kind)
            return real(*args, **kwargs)

        setattr(owner, name, wrapped)

    def _install(self) -> None:
        self._wrap(ckpt, "_tensor_bytes", "tensor")
        self._wrap(os, "fsync", "fsync")
        self._wrap(os, "rename", "rename")
        self._wrap(os, "replace", "replace")
        self._wrap(os, "unlink", "unlink")
        self._wrap(shutil, "rmtree", "rmtree")

    @contextlib.contextmanager
    def saving(self, step: int):
        self.active_step, self.ops, self.counts = step, [], {}
        try:
            yield
        finally:
            self.active_step = None
        emit("saveops", os.getpid(), step, ",".join(self.ops))  # the test parses this; lines stay < PIPE_BUF
        if self.crash is not None and self.crash[0] == step:
            emit("missed", os.getpid())
            os._exit(3)


def sabotage(what: str | None) -> None:
    """Deliberately broken variants, so the test can show that its checks catch such bugs."""
    if what == "rng":  # resume without restoring the RNG streams
        import megatrain.run.train_state as face

        face._restore_rng = lambda meta, tensors: None
    elif what == "latest-first":  # publish the pointer before the checkpoint it names is complete
        real = ckpt.save

        def save(directory: Any, tag: str, *args: Any, **kwargs: Any) -> Any:
            os.makedirs(directory, exist_ok=True)
            ckpt._set_latest(Path(directory), tag)
            return real(directory, tag, *args, **kwargs)

        ckpt.save = save
    elif what is not None:
        raise ValueError(f"unknown sabotage {what!r}")


def train(cmd: dict[str, Any], model: torch.nn.Module) -> None:
    pid = os.getpid()
    steps, every, keep = cmd["steps"], cmd["every"], cmd.get("keep_last")
    ckpt_dir = cmd["ckpt"]
    probe = SaveProbe(cmd.get("crash"), cmd.get("slow_ms", 0.0))
    sabotage(cmd.get("sabotage"))
    engine, *_ = initialize(model=model, config=ds_config(steps, cmd.get("megatrain")))
    start = 0
    if ckpt.latest_tag(ckpt_dir) is not None:
        _, client = engine.load_checkpoint(ckpt_dir)
        start = engine.global_steps
        if client.get("data_position") != start:
            raise RuntimeError(f"data position {client.get('data_position')} != global_steps {start}")
        emit("resume", pid, start)
    emit("start", pid, start)
    stop_ctx = GracefulStop() if cmd.get("graceful") else contextlib.nullcontext()
    with stop_ctx as stop:
        engine.train()
        for step in range(start, steps):
            for micro in range(GAS):
                out = engine(**batch(step, micro))
                engine.backward(out.loss)
                engine.step()
                emit("loss", pid, step, micro, float(out.loss.item()).hex())
            emit("step", pid, engine.global_steps)
            n = engine.global_steps
            if stop is not None and stop.should_stop(engine):
                emit("save-begin", pid, n)
                with probe.saving(n):
                    stop.save_and_exit(engine, ckpt_dir, keep_last=keep, client_state={"data_position": n})
            if n % every == 0 or n == steps:
                emit("save-begin", pid, n)
                with probe.saving(n):
                    engine.save_checkpoint(ckpt_dir, keep_last=keep, client_state={"data_position": n})
                emit("saved", pid, n)
    final = {f"param.{k}": v for k, v in engine.state_dict().items()}
    final["lr"] = torch.tensor(engine.get_lr(), dtype=torch.float64)
    final["counters"] = torch.tensor([engine.global_steps, engine.micro_steps, engine.skipped_steps])
    ckpt.write_safetensors(cmd["out"], final)
    emit("done", pid)


def child(cmd: dict[str, Any], model: torch.nn.Module) -> None:
    code = 1
    try:
        fd = os.open(cmd["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
        train(cmd, model)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    torch.set_num_threads(1)
    model = build_model()  # built once; every child inherits this exact initial state
    # Warm torch's lazy kernel / dispatch setup once here instead of in every child (eval mode: the
    # dropout must not draw from the RNG stream the children inherit).
    model.eval()
    with torch.no_grad():
        model(**batch(0, 0))
    model.train()
    if threading.active_count() != 1:
        raise RuntimeError("the fork server must be single-threaded when it forks")
    emit("ready")
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            child(cmd, model)
        emit("pid", pid)
        _, status = os.waitpid(pid, 0)
        emit("exit", pid, status)


if __name__ == "__main__":
    serve()
