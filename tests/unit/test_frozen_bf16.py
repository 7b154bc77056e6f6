"""A frozen layer loaded in bf16 is held as loaded: 2 bytes a parameter in the host store (no FP32 master, no
shadow, no slab), streamed as such, its weights bit for bit what was loaded, and the training exactly what it is
with the same values held in FP32 (engine/host/codec.py LoadedBf16, engine/model/placement.py loaded_bf16_frozen)."""

from __future__ import annotations

import pytest
import torch
from frozen_cases import BATCHES, CLIP, LR, top_layers_model
from gpu_defaults import FP32, GPU_DEFAULTS
from kit import model_steps

from megatrain.config.schema import EngineConfig
from megatrain.engine import Engine

STEPS = 3


def loaded(dtype: torch.dtype) -> torch.nn.Module:
    """The top 2 of 8 layers trainable (FP32), the embedding and the 6 layers below frozen, those loaded in `dtype`
    (bf16 values either way: one model rounded once, so both loads hold the same numbers)."""
    m = top_layers_model()
    for p in m.parameters():
        p.data = p.data.to(torch.bfloat16).float()
        if not p.requires_grad:
            p.data = p.data.to(dtype)
    return m


def run(model: torch.nn.Module, mode: dict) -> tuple[list[float], Engine, dict]:
    eng = Engine(model, EngineConfig(residency="stream", parity_probe=False, **mode),
                 optimizer=torch.optim.AdamW(model.parameters(), lr=LR), clip_every_step=CLIP)
    losses, stats = model_steps(eng, model, BATCHES[:STEPS])
    return losses, eng, stats


@pytest.mark.parametrize("mode", [pytest.param(FP32, id="fp32"), pytest.param(GPU_DEFAULTS, id="gpu-defaults")])
def test_a_frozen_bf16_layer_is_held_as_loaded(mode):
    bf16, fp32 = loaded(torch.bfloat16), loaded(torch.float32)
    frozen = {n: p.detach().clone() for n, p in bf16.named_parameters() if n.startswith("model.layers.")
              and not p.requires_grad}
    got, eng, stats = run(bf16, mode)
    want, ref, ref_stats = run(fp32, mode)
    assert got == want  # the same values held two ways: the same step, bit for bit
    low = sum(g.numel for g in eng.store.layers[:6])
    held = [g.stream_source.dtype for g in eng.store.layers]
    assert held == [torch.bfloat16] * 6 + [ref.store.layers[6].stream_source.dtype] * 2
    assert all(g.master is None and g.grad is None for g in eng.store.layers[:6])
    # the 6 frozen layers: 2 B a parameter where FP32 (hilo: hi + lo) masters held 4, and an FP32 master's shadow 2
    per_param = 4 + (2 if ref.store.layers[0].master is not None and ref.store.layers[0].shadow is not None else 0)
    # and the frozen embedding, a resident parameter held as loaded too (codec.FrozenTail): 2 B where its FP32 copy held 4
    resident = sum(p.numel() for n, p in bf16.named_parameters() if not n.startswith("model.layers.")
                   and not p.requires_grad)
    assert resident > 0  # control: the embedding is frozen in this case
    assert ref_stats["host_store_bytes"] - stats["host_store_bytes"] == (per_param - 2) * low + 2 * resident
    if mode["compute_dtype"] == "float32":  # streamed in bf16, widened on the device: 2 B less a parameter a load
        saved, layer = ref_stats["h2d_bytes"] - stats["h2d_bytes"], 2 * eng.store.layers[0].numel
        assert saved >= 2 * low and saved % layer == 0, (saved, layer)  # each frozen layer loaded at least once
    # the model object's parameters are the held weights (bf16); its state dict (the engine's FP32 copies in the
    # hilo mode) their values
    state = bf16.state_dict()
    assert all(torch.equal(state[n].float(), v.float()) for n, v in frozen.items()), "a frozen weight moved"
    params = {n: bf16.get_parameter(n) for n in frozen}
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, frozen[n]) and not p.requires_grad
               for n, p in params.items())
