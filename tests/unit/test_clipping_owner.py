"""Gradient clipping has one owner (engine/update/clipping.py): the clip each step takes, and where a clip's
scaling lands (at once; folded into the update's pass; as a bf16 slab widens). The engine and the backend ask
it; no other module computes a clip coefficient."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
from conftest import make_batches, tiny_model

from megatrain.config.schema import EngineConfig
from megatrain.costs.modes import GradSlab
from megatrain.engine import Engine
from megatrain.engine.update.clipping import Clipping

ROOT = Path(__file__).resolve().parents[2] / "megatrain"
COEF = re.compile(r"max_norm\s*/\s*\(")  # torch's coefficient, max_norm / (norm + eps)
BATCHES = make_batches(4)


def _coefficient_sites(files: dict[str, str]) -> list[str]:
    return sorted(name for name, text in files.items() if COEF.search(text))


def test_one_module_computes_the_clip_coefficient():
    files = {p.relative_to(ROOT).as_posix(): p.read_text() for p in ROOT.rglob("*.py")}
    assert _coefficient_sites(files) == ["engine/update/clipping.py"]


def test_the_scan_finds_a_planted_coefficient():
    """Negative control: the engine's clip as it was before the owner, put back."""
    planted = {"engine/engine.py": "coef = min(max_norm / (total + 1e-6), 1.0)\n",
               "engine/update/clipping.py": (ROOT / "engine" / "update" / "clipping.py").read_text()}
    assert _coefficient_sites(planted) == ["engine/engine.py", "engine/update/clipping.py"]


def _slabs(layer_dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(64, generator=gen).to(layer_dtype), torch.randn(16, generator=gen)]  # a layer, the resident


@pytest.mark.parametrize("grad_mode,folds,now,pending", [
    (GradSlab.FLOAT32, False, [True, True], False),  # a whole step: every slab scaled at once, as torch does
    (GradSlab.FLOAT32, True, [False, False], True),  # a per-layer path: scaled in the update's pass
    (GradSlab.BFLOAT16, True, [False, True], True),  # bf16 layers: widened then scaled; the resident FP32 at once
])
def test_where_a_clip_lands(grad_mode, folds, now, pending):
    slabs = _slabs(torch.bfloat16 if grad_mode is GradSlab.BFLOAT16 else torch.float32)
    before = [s.clone() for s in slabs]
    clip = Clipping(grad_mode, folds, lambda: slabs)
    coef = clip.clip(10.0, 1.0)
    assert 0 < coef < 1 and clip.last_norm == 10.0 and clip.clipped
    assert [not torch.equal(s, b) for s, b in zip(slabs, before)] == now
    assert clip.pending == ([coef] if pending else [])
    # A norm read in between sees every slab clipped, wherever the scaling lands: as the update will read it.
    assert all(torch.equal(clip.as_read(s), b.float() * coef) for s, b in zip(slabs, before))
    assert clip.layer_coefs() == clip.pending
    assert clip.resident_coefs() == (clip.pending if clip.folded else [])


def test_a_folded_clip_is_applied_before_more_accumulation_and_once():
    slabs = _slabs(torch.float32)
    before = [s.clone() for s in slabs]
    clip = Clipping(GradSlab.FLOAT32, True, lambda: slabs)
    coef = clip.clip(10.0, 1.0)
    clip.before_backward()  # a clip scales only what came before it
    assert clip.pending == [] and all(torch.equal(s, b * coef) for s, b in zip(slabs, before))
    clip.clip(10.0, 1.0)
    clip.stepped()  # applied in place by the update
    assert clip.pending == []


def test_a_bf16_clip_stays_pending_through_a_step_until_zero_grad():
    slabs = _slabs(torch.bfloat16)
    clip = Clipping(GradSlab.BFLOAT16, True, lambda: slabs)
    coef = clip.clip(10.0, 1.0)
    clip.stepped()  # the bf16 slab itself was never scaled: a second step widens and scales it again
    assert clip.pending == [coef]
    clip.zero_grad()
    assert clip.pending == []


def test_a_clip_that_does_not_bind_scales_nothing():
    slabs = _slabs(torch.float32)
    before = [s.clone() for s in slabs]
    clip = Clipping(GradSlab.FLOAT32, False, lambda: slabs)
    assert clip.clip(0.5, 1.0) == 1.0 and clip.pending == []
    assert all(torch.equal(s, b) for s, b in zip(slabs, before))


def test_the_step_clip_runs_unless_the_caller_clipped():
    calls: list[float] = []
    clip = Clipping(GradSlab.FLOAT32, False, lambda: [], every_step=0.7)

    def by(max_norm: float) -> float:
        calls.append(max_norm)
        clip.clip(3.0, max_norm)
        return 3.0

    assert clip.at_step(by) == 3.0 and calls == [0.7]
    by(0.2)  # the caller clips: the step takes no clip of its own
    assert clip.at_step(by) == 3.0 and calls == [0.7, 0.2]
    clip.set_every_step(0)
    assert clip.at_step(by) is None and calls == [0.7, 0.2]


def test_a_bad_max_norm_is_refused_by_value():
    with pytest.raises(ValueError, match=r"max_norm=-1\.0 must be a number >= 0"):
        Clipping(GradSlab.FLOAT32, False, lambda: [], every_step=-1)
    with pytest.raises(ValueError, match="max_norm='x'"):
        Clipping(GradSlab.FLOAT32, False, lambda: []).set_every_step("x")


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2)


@pytest.mark.parametrize("cfg", [{}, {"optimizer_overlap": True}], ids=["whole step", "folded"])
def test_an_engine_built_with_a_step_clip_trains_as_one_clipped_by_hand(model, cfg):
    """Engine(clip_every_step=...) clips at each step() the caller did not clip: the bits of clip_grad_norm_ called
    before every step; and a caller's own clip replaces the step's (not a second clip on top)."""
    def train(eng: Engine, by_hand: list[float | None]) -> list[torch.Tensor]:
        for b, norm in zip(BATCHES, by_hand):
            eng.backward(eng(**b).loss)
            if norm is not None:
                eng.clip_grad_norm_(norm)
            eng.step()
            eng.zero_grad()
        eng.synchronize()
        return [p.detach().clone() for _, p in eng.named_parameters()]

    ref = train(Engine(copy.deepcopy(model), EngineConfig(**cfg)), [0.05, 0.05, 0.5, 0.05])
    got_eng = Engine(copy.deepcopy(model), EngineConfig(**cfg), clip_every_step=0.05)
    got = train(got_eng, [None, None, 0.5, None])
    assert got_eng.clipping.last_norm is not None
    assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref))


def test_a_bad_step_clip_is_refused_before_the_engine_takes_the_model(model):
    """A negative gradient_clipping handed to the backend once meant no clipping at all, silently; now the engine
    refuses it by value before it moves a weight."""
    from megatrain.backend import MegatrainBackend

    m = copy.deepcopy(model)
    cls, weights = type(m), {n: p.detach().clone() for n, p in m.named_parameters()}
    with pytest.raises(ValueError, match=r"max_norm=-1\.0 must be a number >= 0"):
        MegatrainBackend(cpu=True, gradient_clipping=-1.0).prepare(m, None)
    assert type(m) is cls and all(torch.equal(p, weights[n]) for n, p in m.named_parameters())
