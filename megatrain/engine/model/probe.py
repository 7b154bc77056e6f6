"""The parity probe: before the engine trains an architecture, it proves it trains it exactly.

In parts: probe_shrink.py (the tiny clone), probe_reference.py (plain PyTorch's run), probe_cache.py (the
verdicts kept); this module compares the engine with the reference and decides.

The engine reproduces a Hugging Face model from its parts (embedding, streamed decoder layers, final norm,
chunked head and loss). Any math the model does elsewhere (a scale in the wrapper, a softcap, inputs shared
across layers) would be silently dropped. So on first use of an architecture the engine builds a tiny model of
the same class and structural options (2 layers, small widths, every setting that is not a size kept), trains
it a few steps with plain PyTorch and through the engine on the same batches, and compares first-step
gradients and per-step losses. A mismatch refuses the real model and names the first parameter that differs.

It proves what will train: an engine that computes in bf16 (`compute_dtype`, "auto" on a GPU) is also run in bf16
and its host mode, against plain PyTorch's same mixed-precision scheme (`train_plain`: FP32 masters and gradients,
bf16 compute, the engine's cast points), within a tolerance derived from that reference's own bf16 floor
(`bf16_floor`; docs/COMPATIBILITY.md says how). When plain transformers cannot train the shrunk config, the probe
shrinks less before it refuses anything (`_shrinks`), so it never refuses what plain transformers trains.

The verdict is cached per (model class, structural options, transformers version, compute dtype and host mode) in
`$MEGATRAIN_CACHE` (default `~/.cache/megatrain`), so the real run pays about a second once. The probe draws from
the CPU generator only and restores it; no CUDA generator is touched.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
import transformers
from torch import nn

from .probe_cache import _cache_dir as _cache_dir
from .probe_cache import cache_key as cache_key
from .probe_heads import HeadSubject, head_batches, head_subject, prepare_config
from .probe_reference import _SEQ as _SEQ
from .probe_reference import _VOCAB as _VOCAB
from .probe_reference import ADAM_LR as ADAM_LR
from .probe_reference import LR as LR
from .probe_reference import STEPS as STEPS
from .probe_reference import _batches as _batches
from .probe_reference import _distance, _grad_errors
from .probe_reference import _Mode as _Mode
from .probe_reference import _optimizer as _optimizer
from .probe_reference import bf16_floor as bf16_floor
from .probe_reference import train_plain as train_plain
from .probe_shrink import _MAX_PARAMS as _MAX_PARAMS
from .probe_shrink import _MAX_PARAMS_LESS as _MAX_PARAMS_LESS
from .probe_shrink import _build as _build
from .probe_shrink import _instantiate as _instantiate
from .probe_shrink import _MissingPackage as _MissingPackage
from .probe_shrink import _seed as _seed
from .probe_shrink import less_shrunk_config as less_shrunk_config
from .probe_shrink import tiny_config as tiny_config
from .probe_shrink import two_layer_config as two_layer_config

# First-step gradients relative to the tensor's largest entry, floored at 1e-2 of the model's largest gradient:
# gradients that are zero in exact arithmetic are rounding noise (measured: BioGPT's key bias, whose gradient is
# exactly zero since softmax ignores a shift of all keys, at 1.6e-8 of the largest gradient). Summation order gives
# up to ~4e-6 elsewhere; real defects give 1e-3 and more (Gemma's ignored embedding scale: 0.9).
# The steps are plain SGD: an update linear in the gradient, so a wrong gradient anywhere moves the next loss,
# while Adam would turn rounding noise in near-zero gradients into +-lr updates and blur the comparison.
GRAD_RTOL = 1e-5

LOSS_ATOL = 1e-5

# bf16 compute: the engine against plain PyTorch's same mixed-precision scheme (probe.train_plain), within this
# factor of the reference's own bf16 floor (probe.bf16_floor: how far rounding alone moves the reference). Two
# independent bf16 roundings of one computation differ by up to about twice the floor of either; a real defect
# (a dropped scale, a wrong cast) moves gradients by 1e-1 and more. The smallest floor used: one bf16 ulp.
BF16_FLOOR_FACTOR = 4.0

BF16_MIN_FLOOR = 2.0 ** -8

class ModelMismatchError(ValueError):
    """The parity probe found that the engine would train this architecture differently from PyTorch."""

@dataclass
class Verdict:
    status: str  # "exact" | "mismatch" | "refused" | "crashed"
    detail: str  # why (empty when exact)
    architecture: str  # the model class
    max_grad_rel: float | None = None  # worst first-step gradient error, relative (see GRAD_RTOL)
    max_loss_diff: float | None = None  # worst per-step loss difference
    transformers_version: str = transformers.__version__

    @property
    def exact(self) -> bool:
        return self.status == "exact"


def _ours(exc: BaseException) -> bool:
    """Whether MegaTrain itself raised `exc` (a refusal by name), rather than the model's code failing under it."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and str(tb.tb_frame.f_globals.get("__name__", "")).startswith("megatrain")

def _shrinks(config: Any) -> list[tuple[str, Callable[[Any], Any], int]]:
    """The configs the probe tries, smallest first: (what it is, how to make it, parameter cap)."""
    return [("the probe's shrunk config", tiny_config, _MAX_PARAMS),
            ("a less shrunk config (the user's widths, head dims, ranks and expert shapes; 2 layers, fewer "
             "experts)", less_shrunk_config, _MAX_PARAMS_LESS),
            ("the user's config cut to two layers", two_layer_config, _MAX_PARAMS_LESS)]

class _EngineFailure(Exception):
    def __init__(self, verdict: Verdict) -> None:
        super().__init__(verdict.detail)
        self.verdict = verdict

@contextlib.contextmanager
def _lone_process() -> Iterator[None]:
    """The probe's engine built as a lone process's, in a rank of a data-parallel job too. It compares one engine with
    plain PyTorch on the same small model: joined to the job, it shared a node's host store, so each rank held the
    gradients of its own layers only and the others read as missing ("differs by inf", seen under torchrun with two
    ranks and no cached verdict), and ranks probing at different times would wait on each other's collectives."""
    from ..parallel.distributed import DataParallel

    join = DataParallel.__dict__["from_env"]
    DataParallel.from_env = classmethod(lambda cls, *args, **kwargs: None)  # what a lone process gets
    try:
        yield
    finally:
        DataParallel.from_env = join


def _train_engine(master: nn.Module, batches: list, engine_factory: Callable[..., Any], mode: _Mode,
                  make_opt: Callable[[Any], Any], arch: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same through the engine, in `mode`; a failure raises _EngineFailure with its verdict."""
    from ...config.schema import EngineConfig  # the engine's own settings; a leaf module

    where = " in bfloat16" if mode.bf16 else ""
    mine = copy.deepcopy(master)
    cfg = EngineConfig(device="cpu", parity_probe=False, compute_dtype=mode.compute_dtype,
                       host_master=mode.host_master, host_grad_dtype=mode.host_grad_dtype)
    try:
        with _lone_process():
            engine = engine_factory(mine, cfg, optimizer=make_opt(mine.parameters()))
    except Exception as exc:  # noqa: BLE001
        if isinstance(exc, ValueError | NotImplementedError) and _ours(exc):
            raise _EngineFailure(Verdict("refused", str(exc), arch)) from exc
        raise _EngineFailure(Verdict("crashed", f"the engine failed to take a small {arch}{where}: "
                                     f"{type(exc).__name__}: {exc}", arch)) from exc
    losses: list[float] = []
    grads: dict[str, torch.Tensor] = {}
    # a head of the model's own (probe_heads.py): the model's forward applies it, the engine serves its base's
    runner = engine.module if engine.parts.other_head else engine
    try:
        for step, batch in enumerate(batches):
            _seed(step)
            loss = runner(**batch).loss
            engine.backward(loss)
            if step == 0:
                engine.synchronize()
                got = _slab_grads(engine) if mode.bf16 else {
                    n: p.grad.float().clone() for n, p in engine.named_parameters() if p.grad is not None}
                grads = {**got, **{a: got[n] for a, n in engine._aliases.items() if n in got}}
            losses.append(loss.item())
            engine.step()
            engine.zero_grad()
    except Exception as exc:  # noqa: BLE001
        if isinstance(exc, ValueError | NotImplementedError) and _ours(exc):
            raise _EngineFailure(Verdict("refused", str(exc), arch)) from exc
        hint = "; train it with compute_dtype='float32'" if mode.bf16 else ""
        raise _EngineFailure(Verdict("crashed", f"training a small {arch}{where} failed: {type(exc).__name__}: "
                                     f"{exc}{hint}", arch)) from exc
    finally:
        engine.synchronize()
    return losses, grads

def _slab_grads(engine: Any) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as the host slabs hold it, widened to FP32: in the bf16 modes a layer's `.grad` is
    not a view of its slab (hi/lo masters' parameters are copies; bf16 slabs are read through the FP32 masters)."""
    engine._all_grads()
    return {n: g.view(g.grad, s).float().clone() for n, (g, s) in engine.placement.slots_by_name().items()
            if g.grad is not None}


def _plain_failure(arch: str, tried: list[tuple[str, BaseException]]) -> Verdict:
    first_what, first_exc = tried[0]
    if len(tried) == 1:
        what = f"({first_what})"
    else:
        what = "at every size the probe tries (" + "; ".join(
            f"{w}: {type(e).__name__}: {e}" for w, e in tried[1:]) + ")"
    if isinstance(first_exc, _BuildFailure):
        return Verdict("crashed", f"could not build a small {arch}: {first_exc}"
                       + (f"; nor {what}" if len(tried) > 1 else ""), arch)
    return Verdict("crashed", f"plain transformers fails to train the small {arch} {what}: "
                   f"{type(first_exc).__name__}: {first_exc}", arch)

class _BuildFailure(Exception):
    pass

def run_probe(model_cls: type, config: Any, engine_factory: Callable[..., Any],
              engine_config: Any | None = None, head: HeadSubject | None = None) -> Verdict:
    """Build a tiny `model_cls` of `config`'s structure and compare PyTorch and the engine on it.

    FP32 always (the strict check, GRAD_RTOL / LOSS_ATOL); when `engine_config` computes in bf16, also the engine in
    that dtype and host mode against plain PyTorch's bf16 scheme, within BF16_FLOOR_FACTOR x the reference's own
    bf16 floor (`bf16_floor`). A config plain transformers cannot train when shrunk is shrunk less (`_shrinks`).
    `head`: a decoder under a head of its own, trained on its own loss and batches (probe_heads.py)."""
    arch = head.architecture if head is not None else model_cls.__name__
    mode = _Mode.of(engine_config)
    tried: list[tuple[str, BaseException]] = []
    first: nn.Module | None = None
    with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):  # the caller's CPU stream left as it was
        warnings.simplefilter("ignore")
        for what, shrink, cap in _shrinks(config):
            try:
                tiny = shrink(config)
                tiny = prepare_config(tiny) if head is not None else tiny
                master = _build(model_cls, tiny, config, cap)
                master.float().train()
                first = first or master
            except _MissingPackage as exc:
                return Verdict("crashed", str(exc), arch)
            except Exception as exc:  # noqa: BLE001 - any failure to build is reported, never swallowed silently
                tried.append((what, _BuildFailure(f"{type(exc).__name__}: {exc}")))
                if "cannot build its default config either" in str(exc):
                    break  # not the shrinking: transformers cannot build this config at all
                continue
            max_pos = vars(tiny).get("max_position_embeddings")
            seq = min(_SEQ, max_pos) if isinstance(max_pos, int) and max_pos > 0 else _SEQ
            # Padded batches first; where plain transformers trains the model only without padding (DeepSeek-V3's
            # latent attention with grouped key/value heads fails on any mask), unpadded ones prove that much.
            for pad in (True, False):
                vocab = vars(tiny).get("vocab_size") or _VOCAB
                batches = (head_batches(tiny, head.labelled, STEPS, vocab, seq, pad=pad) if head is not None else
                           _batches(STEPS, vocab, seq, pad=pad))
                try:
                    ref = train_plain(master, batches, torch.float32, _optimizer(mode, False))
                except Exception as exc:  # noqa: BLE001
                    tried.append((what + ("" if pad else ", unpadded batches"), exc))
                    continue
                return _compare(master, batches, ref, engine_factory, mode, arch)
        refusal = _engine_refusal(first, engine_factory, arch) if first is not None else _own_refusal(
            model_cls, config, arch)
    return refusal or _plain_failure(arch, tried)

def _own_refusal(model_cls: type, config: Any, arch: str) -> Verdict | None:
    """The engine's refusal by name of the user's own config, built on the meta device, when no shrink of it builds
    (a shrink that breaks a rule the user's config keeps, e.g. which layers share keys and values): the reason the
    engine would give the real model, rather than the probe's failure to build a small one."""
    from ...models.adapter import find_parts

    try:
        model = _instantiate(model_cls, copy.deepcopy(config), meta=True)
    except Exception:  # noqa: BLE001 - transformers cannot build it: _plain_failure says so
        return None
    try:
        find_parts(model)
    except ValueError as exc:
        return Verdict("refused", str(exc), arch)
    return None

def _engine_refusal(master: nn.Module, engine_factory: Callable[..., Any], arch: str) -> Verdict | None:
    """The engine's own refusal by name of a model plain transformers cannot train either: the more useful reason
    (e.g. no decoder layer stack), or None when the engine takes it."""
    try:
        _train_engine(master, [], engine_factory, _Mode(), _optimizer(_Mode(), False), arch)
    except _EngineFailure as failure:
        return failure.verdict if failure.verdict.status == "refused" else None
    return None

def _compare(master: nn.Module, batches: list, ref: tuple[list[float], dict], engine_factory: Callable[..., Any],
             mode: _Mode, arch: str) -> Verdict:
    try:
        got = _train_engine(master, batches, engine_factory, _Mode(), _optimizer(mode, False), arch)
    except _EngineFailure as failure:
        return failure.verdict
    errors = _grad_errors(ref[1], got[1])
    worst_grad = max((e for _, e in errors), default=0.0)
    bad = next(((n, e) for n, e in errors if not e <= GRAD_RTOL), None)
    if bad is not None:
        return Verdict("mismatch", f"the gradient of {bad[0]} differs from PyTorch's by {bad[1]:.2e} "
                       f"(relative; tolerance {GRAD_RTOL:g})", arch, worst_grad)
    worst_loss = 0.0
    for step, (a, b) in enumerate(zip(ref[0], got[0])):
        worst_loss = max(worst_loss, abs(a - b))
        if not abs(a - b) <= LOSS_ATOL:
            return Verdict("mismatch", f"the loss of step {step} differs from PyTorch's by {abs(a - b):.2e} "
                           f"(tolerance {LOSS_ATOL:g}); first-step gradients agreed", arch, worst_grad, abs(a - b))
    if not mode.bf16:
        return Verdict("exact", "", arch, worst_grad, worst_loss)
    return _compare_bf16(master, batches, engine_factory, mode, arch)

def _compare_bf16(master: nn.Module, batches: list, engine_factory: Callable[..., Any], mode: _Mode,
                  arch: str) -> Verdict:
    make_opt = _optimizer(mode, True)
    fp32 = train_plain(master, batches, torch.float32, make_opt)
    try:
        ref = train_plain(master, batches, torch.bfloat16, make_opt)
    except Exception as exc:  # noqa: BLE001
        return Verdict("crashed", f"plain PyTorch fails to train the small {arch} in bf16 compute with FP32 masters:"
                       f" {type(exc).__name__}: {exc} (the engine's cast points: parameters in bf16, buffers as the"
                       " model holds them); train it with compute_dtype='float32'", arch)
    try:
        got = _train_engine(master, batches, engine_factory, mode, make_opt, arch)
    except _EngineFailure as failure:
        return failure.verdict
    floor_grad, floor_loss, how = bf16_floor(master, batches, make_opt, fp32)
    tol_grad = BF16_FLOOR_FACTOR * max(floor_grad, BF16_MIN_FLOOR)
    tol_loss = BF16_FLOOR_FACTOR * max(floor_loss, BF16_MIN_FLOOR)
    grad, loss, name = _distance(ref, got)
    if not grad <= tol_grad:
        return Verdict("mismatch", f"in bf16 ({mode.host_master} master) the gradient of {name} differs from plain "
                       f"PyTorch's bf16 scheme by {grad:.2e} (relative; tolerance {tol_grad:.1e} = "
                       f"{BF16_FLOOR_FACTOR:g} x the reference's bf16 floor: {how})", arch, grad)
    if not loss <= tol_loss:
        return Verdict("mismatch", f"in bf16 ({mode.host_master} master) a loss differs from plain PyTorch's bf16 "
                       f"scheme by {loss:.2e} (tolerance {tol_loss:.1e} = {BF16_FLOOR_FACTOR:g} x the reference's "
                       f"bf16 floor: {how})", arch, grad, loss)
    return Verdict("exact", "", arch, grad, loss)

_MEMO: dict[str, Verdict] = {}

def verify_model(model: nn.Module, engine_factory: Callable[..., Any], engine_config: Any | None = None) -> Verdict:
    """Run (or recall) the probe for `model`'s architecture in `engine_config`'s compute dtype and host modes (None:
    FP32); raise `ModelMismatchError` unless it is exact."""
    head = head_subject(model)  # a head of its own: the probe's subject is the base under a head (probe_heads.py)
    model_cls, config = head.model_cls if head is not None else type(model), model.config
    key = cache_key(model_cls, config, engine_config)
    verdict = _MEMO.get(key)
    path = _cache_dir() / f"{key}.json"
    if verdict is None and path.exists():
        try:
            verdict = Verdict(**json.loads(path.read_text()))
        except (ValueError, TypeError):
            verdict = None  # a damaged cache entry is re-probed, never trusted
    if verdict is None:
        # The probe trains: a first forward under the caller's no_grad() or inference_mode() (an evaluation
        # before training) must not turn into a refusal of the architecture.
        with torch.inference_mode(False), torch.enable_grad():
            verdict = run_probe(model_cls, config, engine_factory, engine_config, head)
        _MEMO[key] = verdict
        if verdict.status in ("exact", "mismatch"):  # refusals and crashes may depend on the environment
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(asdict(verdict)))
                tmp.replace(path)
            except OSError:
                pass  # an unwritable cache costs a re-probe next time, nothing else
    if not verdict.exact:
        why = {"mismatch": "a small model of the same class and options trained through MegaTrain does not match "
                           "plain PyTorch, so the real one would train wrong",
               "refused": "MegaTrain cannot train this architecture exactly",
               "crashed": "the probe could not show that MegaTrain trains this architecture exactly"}[verdict.status]
        raise ModelMismatchError(
            f"MegaTrain's parity probe refuses {verdict.architecture} ({verdict.status}): {verdict.detail}. In short, "
            f"{why}. Train it with another backend; or, only if you know the difference is harmless, turn the probe "
            "off with EngineConfig(parity_probe=False) (ds_config: \"megatrain\": {\"parity_probe\": false})")
    return verdict
