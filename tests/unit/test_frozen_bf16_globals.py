"""A frozen resident parameter (embedding, head, final norm) loaded in bf16 is held as loaded: 2 bytes a parameter in
the host store (engine/host/codec.py FrozenTail), where an FP32 master held 4, and the training is bit for bit what
it is with the same values held in FP32 (the device computes with the same numbers either way)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from frozen_cases import BATCHES, CLIP, LR
from gpu_defaults import FP32, GPU_DEFAULTS
from kit import model_steps

from megatrain.config.schema import EngineConfig
from megatrain.engine import Engine

STEPS = 3
FROZEN = ("model.embed_tokens.", "lm_head.")
ALL = FROZEN + ("model.norm.",)  # every resident parameter frozen: the group's FP32 master and slab are empty


def loaded(dtype: torch.dtype, frozen: tuple[str, ...] = FROZEN) -> torch.nn.Module:
    """A tiny Llama with its embedding and head frozen, loaded in `dtype` (bf16 values either way: the model is
    rounded once, so both loads hold the same numbers); everything else trains, in FP32."""
    m = tiny_model("llama")
    for n, p in m.named_parameters():
        p.data = p.data.to(torch.bfloat16).float()
        if n.startswith(frozen):
            p.requires_grad_(False)
            p.data = p.data.to(dtype)
    return m


def run(model: torch.nn.Module, mode: dict) -> tuple[list[float], Engine, dict]:
    eng = Engine(model, EngineConfig(residency="stream", parity_probe=False, **mode),
                 optimizer=torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR),
                 clip_every_step=CLIP)
    losses, stats = model_steps(eng, model, BATCHES[:STEPS])
    return losses, eng, stats


@pytest.mark.parametrize("frozen", [pytest.param(FROZEN, id="embed-head"), pytest.param(ALL, id="all-resident")])
@pytest.mark.parametrize("mode", [pytest.param(FP32, id="fp32"), pytest.param(GPU_DEFAULTS, id="gpu-defaults")])
def test_frozen_bf16_globals_are_held_as_loaded(mode, frozen):
    bf16, fp32 = loaded(torch.bfloat16, frozen), loaded(torch.float32, frozen)
    weights = {n: p.detach().clone() for n, p in bf16.named_parameters() if n.startswith(frozen)}
    frozen = sum(w.numel() for w in weights.values())
    assert frozen > 0 and all(w.dtype == torch.bfloat16 for w in weights.values())  # control: the case is there
    got, eng, stats = run(bf16, mode)
    want, ref, ref_stats = run(fp32, mode)
    assert got == want  # the same values held two ways: the same steps, bit for bit
    g = eng.store.globals
    assert g.held_tail is not None and g.held_tail.numel() == frozen  # the frozen ones, 2 B each, nothing else
    assert g.master.numel() == g.numel - frozen and (g.grad is None or g.grad.numel() <= g.numel - frozen)
    assert ref.store.globals.held_tail is None  # control: FP32-loaded, they keep their FP32 master
    # exactly 2 B a frozen resident parameter less than the FP32 master the same values have (no slab, no Adam state
    # for them in either)
    assert ref_stats["host_store_bytes"] - stats["host_store_bytes"] == 2 * frozen
    # the weights never moved, and the engine reads them bit for bit as loaded
    named = dict(eng.placement.named_parameters())
    for n, w in weights.items():
        assert torch.equal(named[n].detach(), w)
        assert torch.equal(eng.placement.device_globals[eng.placement.global_index(n)].detach().cpu(),
                           w.to(eng.placement.device_globals[0].dtype))


def test_the_resident_group_moved_to_a_device_keeps_its_bf16_tail():
    """The resident optimizer moving the resident group onto a device (relocated here, as a GPU's fresh buffers would
    be; update/resident.py move): its FP32 master goes for what trains, the frozen tail's bf16 weights as they are,
    each Parameter views its own part there, and the steps are bit for bit those without the move."""
    from megatrain.engine.update import resident

    def train(move: bool) -> tuple[list[float], Engine]:
        model = loaded(torch.bfloat16)
        eng = Engine(model, EngineConfig(residency="stream", parity_probe=False, **FP32),
                     optimizer=torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR),
                     clip_every_step=CLIP)
        if move:
            old = eng.store.globals.held_tail
            resident.move(eng.store.globals, torch.device("cpu"), relocate=True)
            assert eng.store.globals.held_tail is not old and torch.equal(eng.store.globals.held_tail, old)
        return model_steps(eng, model, BATCHES[:2])[0], eng

    got, eng = train(True)
    want, _ = train(False)
    assert got == want
    g = eng.store.globals
    m = g.master.numel()
    for s, p in zip(g.slots, g.params):
        held = g.master if s.offset < m else g.held_tail
        assert p.untyped_storage().data_ptr() == held.untyped_storage().data_ptr()
        assert p.dtype == (torch.float32 if s.offset < m else torch.bfloat16)
