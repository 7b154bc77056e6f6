"""The final norm + head + loss in sequence tiles with each tile's backward run inside the forward
(engine/layer/loss.py `tiled_norm_head_loss`): the same loss and gradients as the norm followed by the chunked
loss under autograd, and per token only the hidden state's gradient kept for backward."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_model
from gpu_defaults import GPU_DEFAULTS
from kit import train_steps

from megatrain.config.schema import EngineConfig
from megatrain.engine import Engine
from megatrain.engine.layer.loss import IGNORE_INDEX, chunked_causal_lm_loss, tiled_norm_head_loss
from megatrain.engine.layer.tiling import loss_workspace_bytes
from megatrain.engine.runtime.memtrack import DeviceMemoryTracker


def _parts(vocab: int = 96, hidden: int = 32, bias: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    norm = tiny_model("llama", layers=1, hidden=hidden).model.norm
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)  # not all ones: its gradient path is exercised
    return norm, torch.nn.Linear(hidden, vocab, bias=bias)


def _labels(rows: int, seq: int, vocab: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (rows, seq), generator=g)
    labels[0, : seq // 3] = IGNORE_INDEX  # a whole tile without labels, and holes
    labels[-1, seq // 2: seq // 2 + 5] = IGNORE_INDEX
    return labels


def _reference(hidden, norm, head, labels, softcap=None, num_items=None):
    h = hidden.detach().requires_grad_(True)
    loss = chunked_causal_lm_loss(norm(h), head, labels, 64, num_items, softcap)
    params = [h, norm.weight, *head.parameters()]
    return loss.detach(), torch.autograd.grad(loss, params)


def _tiled(hidden, norm, head, labels, tile, softcap=None, num_items=None, scale=1.0):
    h = hidden.detach().requires_grad_(True)
    loss = tiled_norm_head_loss(h, norm, head, labels, tile, num_items, softcap)
    params = [h, norm.weight, *head.parameters()]
    return loss.detach(), torch.autograd.grad(loss * scale, params)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


@pytest.mark.parametrize("softcap,bias,num_items,tile", [(None, False, None, 37), (30.0, True, 50, 64),
                                                          (None, True, torch.tensor(77), 1000)])
def test_same_loss_and_gradients_as_norm_then_chunked_loss(softcap, bias, num_items, tile):
    norm, head = _parts(bias=bias)
    hidden = torch.randn(2, 150, 32)
    labels = _labels(2, 150, 96)
    ref_loss, ref = _reference(hidden, norm, head, labels, softcap, num_items)
    loss, got = _tiled(hidden, norm, head, labels, tile, softcap, num_items)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    for g, r in zip(got, ref):
        assert _rel(g, r) <= 1e-5
    # the incoming gradient scales what was computed in the forward
    _, scaled = _tiled(hidden, norm, head, labels, tile, softcap, num_items, scale=0.25)
    assert all(_rel(s, 0.25 * r) <= 1e-5 for s, r in zip(scaled, ref))


def test_a_one_token_label_change_is_caught_and_a_second_backward_refused():
    """Negative controls: the comparison above sees a single changed label; the gradients are handed over once."""
    norm, head = _parts()
    hidden = torch.randn(1, 200, 32)
    labels = _labels(1, 200, 96)
    _, ref = _reference(hidden, norm, head, labels)
    wrong = labels.clone()
    wrong[0, 150] = (wrong[0, 150] + 1) % 96
    _, got = _tiled(hidden, norm, head, wrong, 50)
    assert max(_rel(g, r) for g, r in zip(got, ref)) > 1e-3
    h = hidden.detach().requires_grad_(True)
    loss = tiled_norm_head_loss(h, norm, head, labels, 50)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backpropagated once already"):
        loss.backward()


def test_engine_loss_and_gradients_equal_pytorchs():
    """The engine's training forward takes this path: loss and every gradient as the HF model computes them."""
    model = tiny_model("llama", layers=2, max_pos=512)
    labels = _labels(2, 300, 256, seed=4)
    ids = labels.clamp_min(0)
    ref = copy.deepcopy(model)
    out = ref(input_ids=ids, labels=labels, use_cache=False)
    out.loss.backward()
    eng = Engine(copy.deepcopy(model), EngineConfig(loss_chunk_tokens=128))
    loss = eng(input_ids=ids, labels=labels).loss
    assert loss.grad_fn is not None and "Precomputed" in type(loss.grad_fn).__name__  # the in-forward path ran
    eng.backward(loss)
    eng.pipeline.synchronize_grads()
    assert abs(loss.item() - out.loss.item()) <= 1e-5
    expect = dict(ref.named_parameters())
    for n, p in eng.named_parameters():
        assert _rel(p.grad, expect[n].grad) <= 1e-5, n


def _loss_phase_peak(fn, tokens: int, hidden: int, vocab: int, tile: int) -> int:
    """Peak live bytes the loss phase adds beyond its input `hidden` (forward and backward)."""
    norm, head = _parts(vocab=vocab, hidden=hidden)
    x = torch.randn(1, tokens, hidden).requires_grad_(True)
    labels = torch.randint(0, vocab, (1, tokens))
    tr = DeviceMemoryTracker(torch.device("cpu"))
    with tr.track():
        loss = fn(x, norm, head, labels, tile)
        torch.autograd.grad(loss, [x, norm.weight, head.weight])
    return tr.peak


def test_loss_phase_keeps_about_one_hidden_vector_per_token():
    """Bytes per token (slope between two lengths, one fixed tile): the in-forward path holds the hidden
    state's gradient (one h-vector) where the norm followed by the chunked loss holds several; the cost
    model's figure for it is within 10% of the measured peak."""
    hidden, vocab, tile, lengths = 64, 128, 256, (2048, 6144)

    def separate(x, norm, head, labels, tile):
        return chunked_causal_lm_loss(norm(x), head, labels, tile)

    new = [_loss_phase_peak(tiled_norm_head_loss, t, hidden, vocab, tile) for t in lengths]
    old = [_loss_phase_peak(separate, t, hidden, vocab, tile) for t in lengths]
    per_token = [(p[1] - p[0]) / (lengths[1] - lengths[0]) / (hidden * 4) for p in (new, old)]
    assert per_token[0] <= 1.1 and per_token[1] >= 3.0, per_token
    for t, p in zip(lengths, new):
        # the cost model counts the last layer's output (the input here) among its per-token terms
        predicted = loss_workspace_bytes(t, hidden, vocab, tile, 4) - t * hidden * 4
        assert abs(predicted / p - 1) <= 0.10, (t, predicted, p)


class _Fills(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the fills (zeros, zero_, fill_) of tensors of one shape."""

    def __init__(self, shape: tuple) -> None:
        super().__init__()
        self.shape, self.count = shape, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in ("fill_", "zero_", "zeros") and torch.is_tensor(out) and tuple(out.shape) == self.shape:
            self.count += 1
        return out


@pytest.mark.parametrize("tile", [300, 37])  # one tile, and several (the first tile's gradient, then the adds)
def test_the_heads_gradient_needs_no_zero_filled_buffer(tile, monkeypatch):
    import megatrain.engine.layer.loss as L

    norm, head = _parts(vocab=96, hidden=32)
    hidden, labels = torch.randn(2, 150, 32), _labels(2, 150, 96)
    with _Fills((96, 32)) as fills:
        _, got = _tiled(hidden, norm, head, labels, tile)
    assert fills.count == 0

    def zeros_then_add(acc, p, hc, out=None):  # the former accumulation: into a zero-filled buffer from the first tile
        acc = torch.zeros(p.shape[1], hc.shape[1]) if acc is None else acc
        return acc.addmm_(p.t(), hc)

    monkeypatch.setattr(L, "_add_head_grad", zeros_then_add)
    with _Fills((96, 32)) as fills:
        _, want = _tiled(hidden, norm, head, labels, tile)
    assert fills.count == 1  # the control: the counter sees the fill it no longer makes
    for a, b in zip(got, want):  # the same bits (a -0 aside, which 0 + x turns to +0 and the slab's add does too)
        assert torch.equal(a, b)


class _Fresh(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that return a new tensor (not in place) of one shape."""

    def __init__(self, shape: tuple) -> None:
        super().__init__()
        self.shape, self.ops = shape, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        # not one that writes a tensor it is given (in place, out=), not a view of one
        writes = any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)
        fresh = not writes and not func.is_view
        if fresh and torch.is_tensor(out) and tuple(out.shape) == self.shape:
            self.ops.append(name)
        return out


def test_a_tile_makes_two_tile_by_vocab_buffers():
    # The logits and their gradient (softmax, target and scale applied in place: a third buffer before, and
    # logsumexp's own exp buffer a fourth).
    norm, head = _parts(vocab=96, hidden=32)
    hidden, labels = torch.randn(1, 150, 32), torch.randint(0, 96, (1, 150))
    with _Fresh((150, 96)) as fresh:  # every position has a label but the last: the whole tile goes through
        _tiled(hidden, norm, head, labels, 1000)
    assert sorted(fresh.ops) == ["empty_like", "mm"], fresh.ops


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_kept_tile_buffers_allocate_nothing_vocab_sized_again_and_change_no_bit(softcap):
    """A CPU device keeps the tile's logits, their gradient and the head's gradient (TileBuffers): from the
    second call on no tile x vocab or vocab x hidden tensor is made, and loss and gradients have the bits of
    fresh buffers. The control: without them each call makes its own."""
    from megatrain.engine.layer.loss import TileBuffers

    norm, head = _parts(vocab=96, hidden=32)
    hidden, labels = torch.randn(1, 150, 32), torch.randint(0, 96, (1, 150))

    def run(buffers):
        h = hidden.detach().requires_grad_(True)
        with _Fresh((150, 96)) as tile, _Fresh((96, 32)) as head_grad:
            loss = tiled_norm_head_loss(h, norm, head, labels, 1000, softcap=softcap, buffers=buffers)
        grads = [g.clone() for g in torch.autograd.grad(loss, [h, norm.weight, head.weight])]
        return loss.detach(), grads, len(tile.ops) + len(head_grad.ops)

    want_loss, want, fresh = run(None)
    assert fresh >= 3  # the control: the logits, their gradient, the head's gradient (a soft cap makes more)
    buffers = TileBuffers()
    run(buffers)
    for _ in range(2):
        loss, got, made = run(buffers)
        # kept: the gradient and the head's gradient, and the logits unless soft-capped (the cap's are its own)
        assert made == fresh - (2 if softcap else 3)
        assert torch.equal(loss, want_loss) and all(torch.equal(a, b) for a, b in zip(got, want))
    small = TileBuffers(cap_bytes=150 * 96 * 4 - 1)  # over the cap: not kept, made each time
    run(small)
    assert run(small)[2] >= 2


def test_head_rows_are_the_labeled_ones_rounded_up_to_the_alignment():
    from megatrain.engine.layer.loss import head_rows

    labeled = torch.ones(150, dtype=torch.bool)
    labeled[[0, 7, 149]] = False
    taken, pos = head_rows(labeled, 64)  # 147 labeled: 192 > 150 rows, so the whole tile
    assert taken is None and torch.equal(pos, labeled.nonzero().squeeze(1))
    labeled = torch.zeros(300, dtype=torch.bool)
    labeled[100:230] = True  # 130 labeled: 192 rows, the labeled first, then the first 62 unlabeled
    taken, pos = head_rows(labeled, 64)
    assert taken.numel() == 192 and torch.equal(taken[:130], torch.arange(100, 230))
    assert torch.equal(taken[130:], torch.arange(62)) and torch.equal(pos, torch.arange(130))
    labeled[100:228] = True
    labeled[228:230] = False  # 128 labeled: already aligned, no unlabeled row added
    taken, pos = head_rows(labeled, 64)
    assert torch.equal(taken, torch.arange(100, 228)) and torch.equal(pos, torch.arange(128))


class _MmRows(torch.utils._python_dispatch.TorchDispatchMode):
    """The row counts of the head's forward GEMMs (those whose output is `vocab` wide)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.rows = vocab, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in ("mm", "addmm") and out.shape[-1] == self.vocab and out.shape[0] > 32:
            self.rows.append(out.shape[0])
        return out


@pytest.mark.parametrize("labeled_rows,want", [(298, 300), (130, 192)])
def test_the_head_runs_on_aligned_rows_with_the_same_loss_and_gradients(labeled_rows, want, monkeypatch):
    """Unlabeled rows ride along to an aligned row count (or the whole tile) and change nothing: the reference
    selects the labeled rows alone. The control: with no rounding the head runs on the ragged count."""
    import megatrain.engine.layer.loss as L

    norm, head = _parts(vocab=96, hidden=32)
    hidden = torch.randn(2, 150, 32)
    labels = torch.randint(0, 96, (2, 150))
    if labeled_rows < 149:
        labels[1] = IGNORE_INDEX
        labels[0, labeled_rows + 1:] = IGNORE_INDEX  # shifted: positions 0 .. labeled_rows - 1 have a label
    with _MmRows(96) as mm:
        loss, got = _tiled(hidden, norm, head, labels, 1000)
    assert mm.rows == [want], mm.rows
    ref_loss, ref = _reference(hidden, norm, head, labels)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    assert all(_rel(g, r) <= 1e-5 for g, r in zip(got, ref))
    monkeypatch.setattr(L, "HEAD_ROW_ALIGN", 1)
    with _MmRows(96) as mm:
        _tiled(hidden, norm, head, labels, 1000)
    assert mm.rows == [labeled_rows]


@pytest.mark.parametrize("mode", [pytest.param({}, id="fp32"), pytest.param(GPU_DEFAULTS, id="gpu-defaults")])
def test_a_plain_cpu_engine_trains_on_kept_tile_buffers_bit_identically(mode):
    """The engine on a plain CPU device keeps the loss tile's buffers (TileBuffers) across steps; training on them
    gives the losses and weights of fresh buffers, bit for bit, in FP32 and in the GPU's defaults (bf16 compute,
    overlap, hilo: the gradient buffer kept, the bf16 logits the head's own). The control engine has none."""
    model = tiny_model("llama", layers=2)
    labels = _labels(2, 40, 256, seed=5)
    batches = [{"input_ids": labels.clamp_min(0), "labels": labels}] * 3
    runs = []
    for keep in (True, False):
        eng = Engine(copy.deepcopy(model), EngineConfig(loss_chunk_tokens=32, **mode))
        if not keep:
            eng._tile_buffers = None
        losses, _ = train_steps(eng, batches, len(batches))
        runs.append((losses, eng.state_dict(), eng._tile_buffers))
    (kept_losses, kept_sd, buffers), (fresh_losses, fresh_sd, _) = runs
    assert buffers is not None and {"logits_grad"} <= set(buffers._held)
    # bf16 logits are widened into a tensor of their own; a bf16 head's gradient is summed in FP32 apart
    assert ("logits" in buffers._held) == ("head_grad" in buffers._held) == (not mode)
    assert kept_losses == fresh_losses and kept_losses[-1] < kept_losses[0]
    assert all(torch.equal(kept_sd[n], fresh_sd[n]) for n in fresh_sd)
