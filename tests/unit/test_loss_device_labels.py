"""Labels on the device (HF Trainer and Accelerate put the batch there) cost the loss no host sync: the batch's
labels are copied to the host, queued, when the forward starts (batch.py PendingCheck.sanitize), and the loss picks
and counts its tokens from that copy (loss.py keep_host_labels), in the same bits as from host labels.

Where no GPU is, device memory is emulated: `_OnDevice` marks a tensor as the device's, whatever is computed from
it stays so, and every read of its values on the host (`.item()`, `bool()`, `.nonzero()`, a copy out...) is
recorded, each being a sync on a GPU. A copy through `to_host` (a queued copy into pinned memory on a GPU, waited
for by its own event) gives a plain host tensor. The batch checks are queued, as for a device batch."""

from __future__ import annotations

import pytest
import torch
from conftest import make_batches
from gpu_defaults import CONFIGS
from kit import bits, cpu_engine
from torch import nn

from megatrain.engine import engine as E
from megatrain.engine.layer import batch as B
from megatrain.engine.layer.loss import chunked_causal_lm_loss, keep_host_labels, tiled_norm_head_loss

# Reads of a tensor's values on the host, and ops whose output size is a count of its values: a sync on a GPU.
_SYNCS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "argwhere", "cpu", "numpy",
          "masked_select", "unique", "unique_consecutive"}


class _OnDevice(torch.Tensor):
    """A tensor standing for one in device memory; `reads` records each sync its values would cost."""

    reads: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        index = args[1] if name in ("__getitem__", "__setitem__") and len(args) > 1 else None
        if name in _SYNCS or (isinstance(index, torch.Tensor) and index.dtype == torch.bool):
            cls.reads.append(name)
        return super().__torch_function__(func, types, args, kwargs or {})


def _emulated_to_host(t: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return t.clone()  # a plain tensor: host memory


@pytest.fixture
def device_batch(monkeypatch):
    """Make a batch's labels the emulated device's, with the checks and copies a device batch gets."""
    monkeypatch.setattr(E, "check_batch", lambda *a, **k: B.check_batch(*a, **k, defer=True))
    monkeypatch.setattr(B, "to_host", _emulated_to_host)
    _OnDevice.reads = []

    def put(batch: dict) -> dict:
        return dict(batch, labels=batch["labels"].as_subclass(_OnDevice))

    return put


def _step(eng, batch: dict, train: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One micro-batch's loss and, training, the gradients it gave (the parameters after an optimizer step)."""
    eng.train(train)
    with torch.set_grad_enabled(train):
        loss = eng(**batch).loss
    if not train:
        return loss.detach(), []
    eng.backward(loss)
    eng.step()
    eng.zero_grad()
    eng.synchronize()
    return loss.detach(), [p.detach().clone() for p in eng.state_dict().values()]


@pytest.mark.parametrize("mode", CONFIGS)
@pytest.mark.parametrize("train", [True, False], ids=["tiled-train", "chunked-eval"])
def test_a_step_with_device_labels_syncs_nothing_in_the_loss_and_keeps_its_bits(device_batch, monkeypatch, mode,
                                                                                 train):
    # 13-token tiles: four over the batch's 48 tokens, one without a label (the padded row's start), the rest ragged
    cfg = dict(mode, loss_chunk_tokens=13)
    batch = make_batches(1)[0]
    batch["labels"][1, :20] = -100
    host = _step(cpu_engine(**cfg), batch, train)
    got = _step(cpu_engine(**cfg), device_batch(batch), train)
    assert _OnDevice.reads == []
    assert torch.equal(bits(got[0]), bits(host[0]))
    assert len(got[1]) == len(host[1]) and all(torch.equal(bits(a), bits(b)) for a, b in zip(got[1], host[1]))

    # Negative control: without the host copy the loss reads the device's labels, a few times per tile (as it did
    # before the copy), in the same bits.
    monkeypatch.setattr(B, "keep_host_labels", lambda labels, host: None)
    _OnDevice.reads = []
    before = _step(cpu_engine(**cfg), device_batch(batch), train)
    assert len(_OnDevice.reads) >= (4 if train else 1), _OnDevice.reads
    assert torch.equal(bits(before[0]), bits(got[0]))
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(before[1], got[1]))


@pytest.mark.parametrize("mode", CONFIGS)
@pytest.mark.parametrize("train", [True, False], ids=["step", "eval"])
def test_a_device_attention_mask_costs_no_read_for_the_attention_layout_and_keeps_the_bits(device_batch, monkeypatch,
                                                                                         mode, train):
    """A padded batch whose mask is on the device too (HF Trainer puts the whole batch there): the segment
    attention's layout (which rows are padded, where the runs are) is read off the mask's host copy queued by the
    batch checks (attention.py keep_host_mask), so a step, forward to optimizer step, reads nothing on the device."""
    batch = make_batches(1)[0]
    batch["attention_mask"][0, 9:12] = 0  # a hole in the first row besides the second's left padding
    batch["labels"][batch["attention_mask"] == 0] = -100

    def on_device(b: dict) -> dict:
        return dict(device_batch(b), attention_mask=b["attention_mask"].as_subclass(_OnDevice))

    host = _step(cpu_engine(**mode), batch, train)
    got = _step(cpu_engine(**mode), on_device(batch), train)
    assert _OnDevice.reads == []
    assert torch.equal(bits(got[0]), bits(host[0]))
    assert len(got[1]) == len(host[1]) and all(torch.equal(bits(a), bits(b)) for a, b in zip(got[1], host[1]))

    # Negative control: without the mask's host copy the layout is read off the device mask (8 reads a step when
    # this was written: the all-valid test, per row a run split and its two lists, the hole's nonzero), same bits.
    monkeypatch.setattr(B, "keep_host_mask", lambda mask, host: None)
    _OnDevice.reads = []
    before = _step(cpu_engine(**mode), on_device(batch), train)
    assert len(_OnDevice.reads) >= 7, _OnDevice.reads
    assert torch.equal(bits(before[0]), bits(got[0]))
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(before[1], got[1]))


def test_the_layout_is_read_off_a_device_masks_kept_copy_on_the_meta_device():
    """On the meta device any read of a value raises: given the copy kept for a device mask, host_mask hands the
    mask function that copy; another device mask without one is read on the device (the control)."""
    from transformers.masking_utils import causal_mask_function

    from megatrain.engine.layer.attention import _segments_mask, host_mask, keep_host_mask

    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0
    on_device = mask.to("meta")
    keep_host_mask(on_device, mask)
    with host_mask(on_device):
        seg = _segments_mask(2, 6, 6, attention_mask=on_device, device="meta", mask_function=causal_mask_function)
    assert [r.runs for r in seg.rows] == [[(True, 0, 6)], [(False, 0, 2), (True, 2, 4)]]
    with pytest.raises((NotImplementedError, RuntimeError)), host_mask(other := mask.to("meta")):
        _segments_mask(2, 6, 6, attention_mask=other, device="meta", mask_function=causal_mask_function)


def test_a_kept_mask_copy_lives_as_long_as_its_mask():
    import gc

    from megatrain.engine.layer import attention as A

    before = len(A._KEPT)
    mask = torch.ones(1, 3, dtype=torch.long)
    A.keep_host_mask(mask, mask)  # a host mask is its own copy: nothing kept
    assert len(A._KEPT) == before
    A.keep_host_mask(mask, mask.clone())
    assert len(A._KEPT) == before + 1
    del mask
    gc.collect()
    assert len(A._KEPT) == before


@pytest.mark.parametrize("tiled", [True, False])
def test_the_loss_takes_device_labels_without_reading_them_given_their_host_copy(tiled):
    """On the meta device any read of a value raises: with the host copy kept, neither loss reads one."""
    hidden = torch.empty(2, 5, 4, device="meta")
    head, norm = nn.Linear(4, 12, bias=False, device="meta"), nn.LayerNorm(4, device="meta")
    labels = torch.tensor([[-100, 3, 4, -100, 1], [2, 2, -100, 7, 0]])
    on_device = labels.to("meta")
    keep_host_labels(on_device, labels)
    if tiled:
        loss = tiled_norm_head_loss(hidden, norm, head, on_device, tile_tokens=3)
    else:
        loss = chunked_causal_lm_loss(hidden, head, on_device, chunk_tokens=3)
    assert loss.device.type == "meta"
    with pytest.raises((NotImplementedError, RuntimeError)):  # negative control: other device labels, no copy
        tiled_norm_head_loss(hidden, norm, head, labels.to("meta"), tile_tokens=3)


def test_a_kept_copy_lives_as_long_as_its_labels():
    import gc

    from megatrain.engine.layer import loss as L

    before = len(L._HOST_LABELS)
    labels = torch.tensor([[1, 2, -100]])
    keep_host_labels(labels, labels)  # host labels are their own copy: nothing kept (it would keep itself alive)
    assert len(L._HOST_LABELS) == before
    keep_host_labels(labels, labels.clone())
    assert len(L._HOST_LABELS) == before + 1 and torch.equal(L.host_labels(labels), labels)
    del labels
    gc.collect()
    assert len(L._HOST_LABELS) == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tiled", [True, False])
def test_cuda_device_labels_with_their_queued_copy_do_not_sync(tiled):
    from megatrain.engine.runtime.host_copy import to_host

    hidden = torch.randn(2, 64, 32, device="cuda", requires_grad=True)
    head, norm = nn.Linear(32, 100, device="cuda"), nn.LayerNorm(32, device="cuda")
    labels = torch.randint(0, 100, (2, 64), device="cuda")
    labels[1, 40:] = -100
    keep_host_labels(labels, to_host(labels))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        if tiled:
            loss = tiled_norm_head_loss(hidden, norm, head, labels, tile_tokens=16)
        else:
            loss = chunked_causal_lm_loss(norm(hidden), head, labels, chunk_tokens=16)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(loss).item()
