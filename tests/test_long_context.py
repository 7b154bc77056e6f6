"""Long context: sequence-tiled layers, offloaded activations, O(tokens) attention, RoPE limits, memory growth.

Peak memory is the engine's measured device accounting (EngineConfig(measure_device_memory=True)): the
live bytes of every tensor the step allocates, so an O(tokens²) tensor anywhere would show.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import transformers
from conftest import make_batches, tiny_config, tiny_model

from megatrain.config import EngineConfig
from megatrain.engine import Engine


def engine(model, **kw) -> Engine:
    kw.setdefault("loss_chunk_tokens", 1024)
    return Engine(copy.deepcopy(model), EngineConfig(**kw))


def grads_of(eng: Engine, batch: dict) -> tuple[float, dict[str, torch.Tensor], dict]:
    """One forward + backward: (loss, gradients by name, stats)."""
    loss = eng(**batch).loss
    eng.backward(loss)
    eng.pipeline.synchronize_grads()
    return loss.item(), {n: p.grad.clone() for n, p in eng.named_parameters()}, eng.collect_stats()


def assert_same(a: tuple, b: tuple, tol: float = 1e-5) -> None:
    assert abs(a[0] - b[0]) <= tol, (a[0], b[0])
    for n, g in a[1].items():
        err = ((b[1][n] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item()
        assert err <= tol, f"{n}: relative gradient error {err:.2e}"


def packed_batch(seq: int, docs: list[int], vocab: int = 256, seed: int = 3) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, seq), generator=g)
    pos = torch.cat([torch.arange(n) for n in docs])[None]
    labels = ids.clone()
    labels[0, torch.cumsum(torch.tensor(docs), 0)[:-1]] = -100  # no label across a document boundary
    return {"input_ids": ids, "position_ids": pos, "labels": labels}


# -- numerics ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family,seq", [("llama", 3072), ("qwen2", 2048)])
def test_tiled_and_offloaded_match_untiled_resident(family, seq):
    """Padded batch of a few thousand tokens: tiling changes only summation order, offload nothing."""
    model = tiny_model(family, layers=2, max_pos=seq, tied=family == "qwen2")
    batch = make_batches(1, seq=seq)[0]
    untiled = grads_of(engine(model, mlp_tile_tokens=None, offload_activations=False), batch)
    tiled_eng = engine(model, mlp_tile_tokens=700, offload_activations=False)  # does not divide 2 x seq
    tiled = grads_of(tiled_eng, batch)
    assert tiled[2]["mlp_tile_tokens"] == 700 and untiled[2]["mlp_tile_tokens"] == 0
    assert_same(untiled, tiled)
    assert any(not torch.equal(untiled[1][n], tiled[1][n]) for n in untiled[1]), "tiling did not run"
    offloaded = grads_of(engine(model, mlp_tile_tokens=700, offload_activations=True), batch)
    assert offloaded[2]["activations_offloaded"] == 1 and offloaded[2]["d2h_bytes"] > tiled[2]["d2h_bytes"]
    assert offloaded[0] == tiled[0]
    assert all(torch.equal(offloaded[1][n], g) for n, g in tiled[1].items())


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_padded_and_packed_batches_match_hf(family):
    """Segment attention + tiling against the HF model's own forward/backward (dense mask) at 1k tokens."""
    kw = {"sliding_window": None} if family == "mistral" else {}
    model = tiny_model(family, layers=2, max_pos=1024, **kw)
    for batch in (make_batches(1, seq=1024)[0], packed_batch(1024, [300, 500, 224])):
        ref = copy.deepcopy(model)
        out = ref(**batch, use_cache=False)
        out.loss.backward()
        expect = out.loss.item(), {n: p.grad for n, p in ref.named_parameters()}
        eng = engine(model, mlp_tile_tokens=256)
        got = grads_of(eng, batch)
        assert eng.segment_attention and got[2]["mlp_tile_tokens"] == 256
        assert_same(expect, got)


def test_packing_keeps_documents_apart():
    """Negative control for the packed case: the same tokens as one document give a different loss."""
    model = tiny_model("llama", layers=2, max_pos=1024)
    packed = packed_batch(1024, [512, 512])
    joined = dict(packed, position_ids=torch.arange(1024)[None])
    eng = engine(model)
    with torch.no_grad():
        a, b = eng(**packed).loss.item(), eng(**joined).loss.item()
        second = eng(**{k: v[:, 512:] for k, v in packed.items()}).loss.item()
        first = eng(**{k: v[:, :512] for k, v in packed.items()}).loss.item()
    assert abs(a - b) > 1e-3
    n1 = int((packed["labels"][0, 1:512] != -100).sum())
    n2 = int((packed["labels"][0, 513:] != -100).sum())
    assert a == pytest.approx((first * n1 + second * n2) / (n1 + n2), abs=1e-5)


# -- memory --------------------------------------------------------------------------------------------

def peak_bytes(model, seq: int, **kw) -> dict:
    eng = engine(model, measure_device_memory=True, **kw)
    return grads_of(eng, make_batches(1, seq=seq)[0])[2]


def quadratic_share(lengths: list[int], peaks: list[float]) -> float:
    """Share of the largest peak that a fitted quadratic term explains."""
    c2 = np.polyfit(np.array(lengths, float), np.array(peaks, float), 2)[0]
    return c2 * max(lengths) ** 2 / max(peaks)


def test_peak_device_bytes_grow_linearly_with_sequence_length():
    model = tiny_model("llama", layers=2, max_pos=2048)
    lengths = [512, 1024, 1536, 2048]
    peaks = [peak_bytes(model, s, mlp_tile_tokens=256)["peak_device_bytes"] for s in lengths]
    slope, icpt = np.polyfit(lengths, peaks, 1)
    resid = np.abs(np.array(peaks) - (slope * np.array(lengths) + icpt)).max()
    assert slope > 0 and resid <= 0.02 * max(peaks), (peaks, resid)
    assert abs(quadratic_share(lengths, peaks)) <= 0.02, peaks
    # Negative control: HF's own attention materializes a [batch, 1, seq, seq] mask for padded batches.
    short = [256, 512, 768, 1024]
    dense = [peak_bytes(model, s, mlp_tile_tokens=256, segment_attention=False)["peak_device_bytes"] for s in short]
    assert quadratic_share(short, dense) > 0.1, dense


def test_tiling_shrinks_the_peak_and_prediction_tracks_it():
    model = tiny_model("llama", layers=2, hidden=128, max_pos=2048)
    untiled = peak_bytes(model, 2048, mlp_tile_tokens=None)
    tiled = peak_bytes(model, 2048, mlp_tile_tokens=256)
    assert tiled["peak_device_bytes"] < 0.7 * untiled["peak_device_bytes"]
    for st in (untiled, tiled):
        err = st["predicted_peak_device_bytes"] / st["peak_device_bytes"] - 1
        assert abs(err) <= 0.10, f"predicted vs measured: {err:+.1%}"


def test_offloaded_peak_does_not_grow_with_depth():
    seq = 1024
    off = {n: peak_bytes(tiny_model("llama", layers=n, max_pos=seq), seq, offload_activations=True,
                         mlp_tile_tokens=256)["peak_device_bytes"] for n in (2, 4, 8)}
    assert max(off.values()) - min(off.values()) <= 0.01 * min(off.values()), off
    res = {n: peak_bytes(tiny_model("llama", layers=n, max_pos=seq), seq, offload_activations=False,
                         mlp_tile_tokens=256)["peak_device_bytes"] for n in (2, 8)}
    assert res[8] > 1.2 * res[2], res  # resident boundary activations do grow: the test can fail


def test_auto_offloads_and_tiles_to_fit_the_device_budget():
    model = tiny_model("llama", layers=6, max_pos=2048)
    free = peak_bytes(model, 2048)  # no budget on a CPU device: nothing offloaded, small MLP left whole
    assert free["activations_offloaded"] == 0 and free["mlp_tile_tokens"] == 0
    budget = int(0.7 * free["peak_device_bytes"])
    fit = peak_bytes(model, 2048, device_budget_bytes=budget)
    assert fit["activations_offloaded"] == 1 and 0 < fit["mlp_tile_tokens"] < 2 * 2048
    assert fit["peak_device_bytes"] <= budget, (fit["peak_device_bytes"], budget)


# -- RoPE ------------------------------------------------------------------------------------------------

def test_rope_scaling_extends_the_limit_and_is_respected():
    batch = make_batches(1, seq=1024)[0]
    with pytest.raises(ValueError, match="max_position_embeddings=512"):
        Engine(tiny_model("llama", layers=1, max_pos=512))(**batch)
    torch.manual_seed(0)
    scaled_cfg = tiny_config("llama", layers=1, max_pos=512, rope_scaling={"rope_type": "linear", "factor": 4.0})
    scaled = transformers.AutoModelForCausalLM.from_config(scaled_cfg)
    eng = engine(scaled)
    with torch.no_grad():
        got = eng(**batch).loss.item()
        expect = scaled(**batch, use_cache=False).loss.item()
        plain = copy.deepcopy(scaled)
        plain.config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
        plain.model.rotary_emb = type(plain.model.rotary_emb)(plain.config)
        unscaled = plain(**batch, use_cache=False).loss.item()
    assert got == pytest.approx(expect, abs=1e-5)
    assert abs(got - unscaled) > 1e-4  # the scaling is in effect, not just the limit
    with pytest.raises(ValueError, match=r"extends it to 2048"):
        eng(**make_batches(1, seq=2049)[0])


def test_packed_positions_are_checked_not_the_row_length():
    eng = engine(tiny_model("llama", layers=1, max_pos=512))
    with torch.no_grad():
        eng(**packed_batch(1024, [512, 512]))  # two documents of 512 positions each: fine
        with pytest.raises(ValueError, match="position 599 exceeds"):
            eng(**packed_batch(1024, [600, 424]))
