"""A no-grad eval on training's placement (kept layers) is bit-identical to the same eval streamed.

Under a device budget the eval's plan sizes its head/loss chunk from the room the placement leaves (costs/memory.py):
with the 6 layers' weights kept the 8 x 512 eval's chunk is 128 tokens, streamed 256. The chunked loss once added each
chunk's sum into its total, so the loss's summation order followed the placement (5.560976028 kept, 5.560975552
streamed); every token's loss is written into one vector and summed once (loss.py), the same bits whatever the chunk.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import tiny_model

from megatrain.config import EngineConfig
from megatrain.engine import Engine

LAYERS = 6
# A CPU device emulating a 6 MiB card and its link: training at 1 x 64 keeps every layer's weights.
EMULATED = {"compute_dtype": "float32", "device_budget_bytes": 6 << 20, "link_gbps": 100.0}


def _eval(residency: str, **extra) -> tuple[int, int, torch.Tensor]:
    """One training step at 1 x 64, then a no-grad eval at 8 x 512: (kept layers, the eval's loss chunk, its loss)."""
    model = tiny_model("llama", layers=LAYERS)
    eng = Engine(model, EngineConfig(residency=residency, **EMULATED, **extra),
                 optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (1, 64), generator=g)
    out = eng(input_ids=ids, labels=ids)
    eng.backward(out.loss)
    eng.step()
    eng.zero_grad()
    eng.eval()
    ids = torch.randint(0, 256, (8, 512), generator=g)
    with torch.no_grad():
        loss = eng(input_ids=ids, labels=ids).loss
    st = eng.collect_stats()
    return int(st["resident_weight_layers"]), int(st["loss_chunk_tokens"]), loss.detach()


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the emulation's "does not fit" warnings belong to other tests
        yield


def test_the_kept_and_streamed_evals_differ_only_in_their_loss_chunk():
    kept, chunk, _ = _eval("auto")
    streamed, stream_chunk, _ = _eval("stream")
    assert kept == LAYERS and streamed == 0
    assert chunk < stream_chunk, (chunk, stream_chunk)  # the placement's room sizes the chunk
    # one chunk for both (the setting, which the plan keeps when it fits): the same bits
    _, a_chunk, a = _eval("auto", loss_chunk_tokens=chunk)
    _, b_chunk, b = _eval("stream", loss_chunk_tokens=chunk)
    assert a_chunk == b_chunk == chunk
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_an_eval_on_trainings_placement_is_bit_identical_to_the_streamed_one():
    _, _, kept = _eval("auto")
    _, _, streamed = _eval("stream")
    assert torch.equal(kept.view(torch.int32), streamed.view(torch.int32)), (kept.item(), streamed.item())
