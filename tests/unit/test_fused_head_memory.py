"""TRL's fused LM head on the engine holds no full logits: measured, against the full-logits path it replaced.

Both paths run the same engine forward and backward under the engine's device-memory tracker (every storage
created on the compute device, op by op); the only difference is the head. The full logits of this batch are
`tokens x vocab x 4` bytes; the fused head's workspace is one head chunk of them, whatever the tokens.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

import megatrain
from megatrain.engine.runtime.memtrack import DeviceMemoryTracker

VOCAB, CHUNK, SEQ = 8192, 64, 128


def _engine():
    from trl.trainer.utils import add_fused_lm_head

    model = tiny_model(hidden=32, vocab=VOCAB, heads=2, kv_heads=1)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "megatrain": {"device": "cpu", "loss_chunk_tokens": CHUNK}}
    engine, *_ = megatrain.initialize(model=model, config=config)
    return engine, model


def _peaks(engine, model, rows: int) -> dict[str, int]:
    """Device peak of one forward + backward of `rows` x SEQ tokens through each head."""
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(rows))

    def chunked_loss():  # the engine's own chunked head: the reference for what every head keeps per token
        return model(input_ids=ids, labels=ids).loss

    def fused():
        return model(input_ids=ids, labels=ids, fused_lm_head=True).loss

    def full_logits():  # what the fused head did before: the logits, then log-softmax over them
        logits = model(input_ids=ids, return_logits=True).logits[:, :-1].float()
        return -torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1).mean()

    peaks, losses = {}, []
    for run in (chunked_loss, fused, full_logits):
        tracker = DeviceMemoryTracker(torch.device("cpu"))
        with tracker.track():
            loss = run()
            engine.backward(loss)
        losses.append(loss.item())
        engine.zero_grad()
        peaks[run.__name__] = tracker.peak
    assert losses[1] == pytest.approx(losses[0], rel=1e-5) and losses[2] == pytest.approx(losses[0], rel=1e-5)
    return peaks


def test_fused_head_memory_does_not_grow_with_the_logits():
    """Four times the rows: the full-logits path grows by (at least) the logits and their gradient, the fused
    head by no more than the engine's own chunked loss does (the per-token vectors any head keeps)."""
    engine, model = _engine()
    _peaks(engine, model, 1)  # warm-up: first-use allocations count in no measurement
    small, big = _peaks(engine, model, 2), _peaks(engine, model, 8)
    grown = {k: big[k] - small[k] for k in big}
    grown_logits = (8 - 2) * SEQ * VOCAB * 4
    print(f"device peak per token at {8 * SEQ} tokens: " + ", ".join(f"{k} {v / (8 * SEQ):.0f} B" for k, v in
                                                                      big.items()) + f"; the logits alone {VOCAB * 4} B")
    assert grown["full_logits"] > grown["chunked_loss"] + 2 * grown_logits
    assert grown["fused"] < grown["chunked_loss"] + grown_logits / 20
