"""What every phase shares: the phase list and time budgets, the small shapes and models of the correctness
phases, and the per-phase context that records each check the moment it finishes."""

from __future__ import annotations

import dataclasses
import json
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatrain.files.atomic import atomic_write

REPO_ROOT = Path(__file__).resolve().parents[2]
SWEEP_NAME = "gpu_check"


# -- phases and budgets ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PhaseSpec:
    name: str
    budget_s: float  # on the GPU
    dry_budget_s: float  # in --dry-run
    # run on a GPU only when named in --only (the dry run runs it: its CPU emulation costs no GPU time)
    optional: bool = False
    # devices it needs: with fewer it records itself skipped at once, so a one-GPU machine's time plan leaves it out
    gpus: int = 1


PHASES = [  # correctness first: a failure is known within minutes, and `--only` reruns just what failed
    PhaseSpec("env", 10, 30),
    PhaseSpec("parity", 30, 90),
    PhaseSpec("features", 25, 60),  # speculation, NaN skip, device batches under sync-debug "error", stream vs auto
    PhaseSpec("sync", 20, 45),  # every loop streamed and at a partial placement
    PhaseSpec("stress", 20, 45),
    # The stream sanitizer's three configurations at two placements take ~75 s on a GPU, which the bench's
    # guaranteed time leaves no room for in the one prepared run: `--only sanitizer` runs it.
    PhaseSpec("sanitizer", 75, 90, optional=True),
    PhaseSpec("bandwidth", 10, 20),
    # The node path on two GPUs under torchrun (dp2.py); skipped in a moment with fewer (the dry run hides them all).
    PhaseSpec("dp2", 30, 10, gpus=2),
    PhaseSpec("bench", 0, 200),  # on a GPU: all that is left, never under BENCH_MIN_S (run_phases)
]
# From the wrapper's start (wheel install included) to the summary: the correctness phases' caps fit in it beside
# the bench's guaranteed time, and the whole check twice (a rerun) fits one 10-minute command (README.md).
TOTAL_BUDGET_S = 280.0
DRY_TOTAL_BUDGET_S = 280.0  # the same budget on the CPU (the bench runs beside the other phases there)
SUMMARY_RESERVE_S = 12.0
# The bench's time on a GPU, guaranteed: every phase before it in the same run is cut to leave this much.
BENCH_MIN_S = 120.0
# What the wrapper and the child's imports may take before the first phase starts (python, torch, transformers
# and megatrain imported; no wheels to install on the image the README names).
STARTUP_ALLOWANCE_S = 25.0


# -- small shapes for the correctness phases ---------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Shapes:
    hidden: int
    layers: int
    vocab: int
    seq: int
    batch: int


SHAPES = {  # (phase, on_gpu) -> shapes; the CPU ones are the test suite's
    ("parity", False): Shapes(64, 3, 256, 24, 2),
    ("parity", True): Shapes(128, 4, 512, 64, 2),
    ("sync", False): Shapes(64, 3, 256, 32, 2),
    ("sync", True): Shapes(256, 4, 1024, 128, 2),
    ("stress", False): Shapes(64, 4, 256, 32, 2),
    ("stress", True): Shapes(512, 6, 1024, 256, 2),
}


def tiny_model(family: str, sh: Shapes, seed: int = 0, tied: bool = False) -> Any:
    import torch
    import transformers

    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family]
    cfg = cls(hidden_size=sh.hidden, intermediate_size=sh.hidden * 11 // 4, num_hidden_layers=sh.layers,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=sh.vocab, max_position_embeddings=2048,
              tie_word_embeddings=tied)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def make_batches(n: int, sh: Shapes, seed: int = 1) -> list[dict[str, Any]]:
    """Left-padded second row, -100 labels on padding and on a few random tokens (as the tests do)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, sh.vocab, (sh.batch, sh.seq), generator=g)
        mask = torch.ones_like(ids)
        if sh.batch > 1:
            mask[1, : sh.seq // 4] = 0
        labels = ids.clone()
        labels[mask == 0] = -100
        labels[0, torch.randint(0, sh.seq, (3,), generator=g)] = -100
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


# -- per-phase context ---------------------------------------------------------------------------------
class Ctx:
    """What a phase function gets: where to run, which shapes, and a recorder that writes each check's
    result the moment it is known (a phase killed at its deadline keeps what it finished)."""

    def __init__(self, phase: str, out: Path, dry: bool, deadline: float) -> None:
        import torch

        self.phase = phase
        self.out = out
        self.dry = dry
        self.deadline = deadline
        self.cuda = not dry and torch.cuda.is_available()
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.file = out / "phases" / f"{phase}.json"
        self.started = time.time()
        self.data: dict[str, Any] = {"phase": phase, "status": "running", "device": str(self.device),
                                     "started": self.started, "deadline": deadline,
                                     "budget_s": round(deadline - self.started, 1),
                                     "checks": {}}
        self._write()

    def shapes(self, phase: str | None = None) -> Shapes:
        return SHAPES[(phase or self.phase, self.cuda)]

    def _write(self) -> None:
        _atomic_write(self.file, json.dumps(self.data, indent=1, default=_json_default))

    def check(self, name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Run one check; its dict must say `ok`. An exception fails this check, not the phase."""
        t0 = time.perf_counter()
        try:
            res = fn()
        except Exception as exc:  # noqa: BLE001 - recorded, and the next check still runs
            res = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:600],
                   "traceback": traceback.format_exc()[-3000:]}
        res["wall_s"] = round(time.perf_counter() - t0, 3)
        self.data["checks"][name] = res
        self._write()
        _log(f"  {self.phase}.{name}: {'ok' if res.get('ok') else 'FAILED'} ({res['wall_s']:.1f} s)"
             + (f" {res['error']}" if res.get("error") else ""))
        return res

    def info(self, **kw: Any) -> None:
        self.data.setdefault("info", {}).update(kw)
        self._write()

    def finish(self) -> None:
        import sys

        # the GPU image's packages: nothing the check runs may need pandas or DeepSpeed (README.md)
        self.data["modules_not_on_the_image"] = sorted(m for m in ("pandas", "deepspeed", "trl") if m in sys.modules)
        checks = self.data["checks"].values()
        if self.data["status"] != "skipped":  # a phase that says why it cannot run here (dp2: one GPU) keeps that
            self.data["status"] = "ok" if all(c.get("ok") for c in checks) else "failed"
        self.data["wall_s"] = round(time.time() - self.started, 1)
        self._write()


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    return str(o)


_atomic_write = atomic_write  # the phases' records: whole or absent, whatever stops a phase


_T0 = float(os.environ.get("GPU_CHECK_T0", time.time()))


def _log(msg: str) -> None:
    print(f"[{time.time() - _T0:6.1f}s] {msg}", flush=True)


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


FINAL = ("ok", "failed", "timeout", "skipped")


def _first_error(rec: dict[str, Any]) -> str:
    for c in rec.get("checks", {}).values():
        if c.get("error"):
            return c["error"][:200]
    return rec.get("reason", "")


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
