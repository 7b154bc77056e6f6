"""Per-micro-batch work that must not make the host wait for the device, checked where no GPU is: the meta
device stands in for it (an op that needs the device's values on the host, such as torch.unique or a boolean
mask whose output size is data, cannot run there), and the same call on the CPU gives the same bits."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megatrain.engine.layer.embedding import lookup_grad


def _ids() -> torch.Tensor:
    return torch.tensor([[5, 0, 7, 5, 3], [3, 3, 0, 9, 1]], dtype=torch.int32)  # duplicates and padding (0)


@pytest.mark.parametrize("padding_idx", [0, None])
def test_the_embedding_rows_are_found_from_host_ids_without_reading_the_device(padding_idx):
    embed = nn.Embedding(12, 4, padding_idx=padding_idx, device="meta")
    g = torch.empty(2, 5, 4, device="meta")
    rows, grad = lookup_grad(embed, _ids(), g)  # would raise on any op that reads device values
    want = [1, 3, 5, 7, 9] if padding_idx == 0 else [0, 1, 3, 5, 7, 9]
    assert rows.device.type == "cpu" and rows.tolist() == want and grad.shape == (len(want), 4)


def test_negative_control_device_ids_need_the_device_values():
    embed = nn.Embedding(12, 4, padding_idx=0, device="meta")
    with pytest.raises(NotImplementedError):
        lookup_grad(embed, _ids().long().to("meta"), torch.empty(2, 5, 4, device="meta"))


@pytest.mark.parametrize("padding_idx", [0, None])
def test_host_ids_give_the_same_rows_and_gradients(padding_idx):
    torch.manual_seed(0)
    embed = nn.Embedding(12, 4, padding_idx=padding_idx)
    g = torch.randn(2, 5, 4)
    want = lookup_grad(embed, _ids().long(), g, host=False)
    got = lookup_grad(embed, _ids(), g, host=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_host_pool_grows_geometrically_not_to_each_batch():
    from megatrain.engine.pipeline.activations import GROWTH, HostPool

    allocs: list[int] = []
    pool = HostPool(lambda n, dtype, what: (allocs.append(n), torch.empty(n, dtype=dtype))[1])
    needs = list(range(1000, 3001, 100))  # a batch a little longer each time
    for n in needs:
        assert pool.get(0, n, torch.bfloat16).numel() == n
    assert len(allocs) <= 4, allocs  # to the exact size it would pin again for each of the 21 batches
    assert max(allocs) <= GROWTH * max(needs)  # the headroom is bounded
    pool.get(0, 10, torch.float32)  # another dtype: a buffer of its own size
    assert allocs[-1] == 10


def test_trace_records_and_synchronizes_on_the_engines_device_not_the_current_one(monkeypatch):
    from megatrain.engine.runtime import stream as S

    seen: dict[str, list] = {"sync": [], "record": []}

    class FakeEvent:
        def __init__(self, enable_timing: bool = False) -> None:
            pass

        def record(self, stream=None) -> None:
            seen["record"].append(stream)

    monkeypatch.setattr(S.torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(S.torch.cuda, "current_stream", lambda device=None: ("stream of", device))
    monkeypatch.setattr(S.torch.cuda, "synchronize", lambda device=None: seen["sync"].append(device))
    dev = torch.device("cuda", 1)  # the current device is 0 (or none): every call must name cuda:1
    trace = S.Trace(True, dev)
    trace.add_since("compute", "fwd", 0, trace.mark())
    assert seen["sync"] == [dev]
    assert seen["record"] == [("stream of", dev)] * 3  # the clock's reference, the span's start and end


def test_a_side_stream_runs_its_jobs_with_its_share_of_the_threads():
    from megatrain.engine.runtime.stream import DONE, CopyStream, Trace, side_threads

    assert [side_threads(n) for n in (1, 2, 4, 16, 64)] == [1, 1, 1, 4, 16]
    main_threads = torch.get_num_threads()
    s = CopyStream("side", torch.device("cpu"), Trace(False))
    seen: list[int] = []
    s.submit(lambda: seen.append(torch.get_num_threads()) or 0, DONE, "job", 0).host_wait(10.0)
    s.threads = 1
    s.submit(lambda: seen.append(torch.get_num_threads()) or 0, DONE, "job", 0).host_wait(10.0)
    assert seen[-1] == 1 and torch.get_num_threads() == main_threads  # its own team, not the caller's


def _padded_mask() -> torch.Tensor:
    m = torch.ones(3, 10, dtype=torch.long)
    m[0, :4] = 0  # left padding
    m[1, 6:] = 0  # right padding
    m[2, 3:5] = 0  # a hole: the valid tokens are not one slice
    return m


@pytest.mark.parametrize("dense", [False, True])
def test_the_attention_layout_is_read_off_the_host_mask_without_reading_the_device(dense):
    from transformers.masking_utils import causal_mask_function

    from megatrain.engine.layer.attention import _segments_mask, host_mask

    host = _padded_mask()
    from types import SimpleNamespace

    kw = dict(mask_function=causal_mask_function, dense_when_small=dense, dtype=torch.float32,
              config=SimpleNamespace(num_attention_heads=4, hidden_size=64))
    want = _segments_mask(3, 10, 10, attention_mask=host, device="cpu", **kw)
    with host_mask(host):
        got = _segments_mask(3, 10, 10, attention_mask=host.to("meta"), device="meta", **kw)
    assert [(r.runs, r.docs) for r in got.rows] == [(r.runs, r.docs) for r in want.rows]
    assert [r.valid_idx is None for r in got.rows] == [r.valid_idx is None for r in want.rows] == [True, True, False]
    assert got.rows[2].valid_idx.device.type == "meta"  # moved to the device, not read from it
    assert (got.dense is None) == (want.dense is None) == (not dense)


def test_negative_control_without_the_host_mask_the_layout_reads_the_device():
    from transformers.masking_utils import causal_mask_function

    from megatrain.engine.layer.attention import _segments_mask

    with pytest.raises((NotImplementedError, RuntimeError), match="meta"):  # bool(valid.all()) reads the device
        _segments_mask(3, 10, 10, attention_mask=_padded_mask().to("meta"), device="meta",
                       mask_function=causal_mask_function)


def test_the_accelerate_loader_leaves_the_batch_on_the_host():
    """The face's loader hands the batch over where it is: the engine copies the ids and reads the rest (valid
    labels, padding, the embedding's rows) on the host. Moved to the device first, each read is a sync."""
    from megatrain import Accelerator

    data = [{"input_ids": torch.arange(6).view(2, 3), "labels": torch.arange(6).view(2, 3)} for _ in range(3)]
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    prepared = Accelerator(backend="megatrain").prepare(loader)
    assert prepared.device is None  # accelerate's loader with no device to move the batches to
    batches = list(prepared)
    assert len(batches) == 3
    assert all(t.device.type == "cpu" for b in batches for t in b.values())
    # Control: the same loader prepared with device placement asked for gets the device.
    assert Accelerator(backend="megatrain").prepare_data_loader(loader, device_placement=True).device is not None


@pytest.mark.parametrize("mask", [False, True])
def test_segment_starts_are_read_on_the_host_with_or_without_a_mask(mask):
    """Where documents start is decided from the mask function evaluated on host indices, mask or none; the
    device's copy of the starts (for the dense mask) is never read back."""
    from megatrain.engine.layer.attention import _segments_mask, host_mask

    host = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    with host_mask(host if mask else None):
        seg = _segments_mask(2, 4, 4, attention_mask=host.to("meta") if mask else None, device="meta")
    assert (seg is None) != mask  # plain causal without a mask; a padded row with one


def test_negative_control_device_starts_need_the_device_values(monkeypatch):
    import megatrain.engine.layer.attention as A

    monkeypatch.setattr(A, "_host_starts", lambda *a: None)  # as before: no mask, the device's starts read back
    with pytest.raises((NotImplementedError, RuntimeError)):
        A._segments_mask(2, 4, 4, device="meta")


@pytest.mark.parametrize("tiled", [True, False])
def test_the_loss_counts_and_picks_valid_labels_on_the_host(tiled):
    """Host labels: which tokens count, how many, and each tile's rows are found without reading the device."""
    from megatrain.engine.layer.loss import chunked_causal_lm_loss, tiled_norm_head_loss

    hidden = torch.empty(2, 5, 4, device="meta")
    head, norm = nn.Linear(4, 12, bias=False, device="meta"), nn.LayerNorm(4, device="meta")
    labels = torch.tensor([[-100, 3, 4, -100, 1], [2, 2, -100, 7, 0]])
    if tiled:
        loss = tiled_norm_head_loss(hidden, norm, head, labels, tile_tokens=3)
    else:
        loss = chunked_causal_lm_loss(hidden, head, labels, chunk_tokens=3)
    assert loss.device.type == "meta"
    with pytest.raises((NotImplementedError, RuntimeError)):  # negative control: device labels must be read back
        tiled_norm_head_loss(hidden, norm, head, labels.to("meta"), tile_tokens=3)


class _PendingCopy:
    """A copy still queued (done() False until released); host_wait records the order it was waited in."""

    def __init__(self, log: list) -> None:
        self.log = log

    def done(self) -> bool:
        return False

    def host_wait(self, timeout: float) -> None:
        self.log.append("waited for the last copy")


def test_a_growing_host_pool_waits_for_the_buffers_last_copy_before_freeing_it():
    from megatrain.engine.pipeline.activations import HostPool

    log: list = []
    pool = HostPool(lambda n, dtype, what: (log.append(f"alloc {n}"), torch.empty(n, dtype=dtype))[1])
    pool.get(0, 100, torch.float32)
    pool.copied(0, _PendingCopy(log))
    pool.get(0, 50, torch.float32)  # fits: reused, nothing freed, no wait
    assert log == ["alloc 100"]
    pool.get(0, 1000, torch.float32)  # grows: the old buffer is freed only after its queued copy
    assert log == ["alloc 100", "waited for the last copy", "alloc 1000"]
    pool.get(0, 5000, torch.float32)  # no copy queued since: nothing to wait for
    assert log[-1] == "alloc 5000" and log.count("waited for the last copy") == 1


def test_the_activation_store_names_each_copy_to_its_pool():
    """Each put's copy out, then each fetch's copy back (queued behind it), is the buffer's last copy."""
    from megatrain.engine.pipeline.activations import ActivationStore, HostPool
    from megatrain.engine.runtime.stream import Streams, Trace

    streams = Streams(torch.device("cpu"), Trace(False, torch.device("cpu")), None, 5.0)
    pool = HostPool(lambda n, dtype, what: torch.empty(n, dtype=dtype))
    acts = ActivationStore(streams, True, pin=pool)
    acts.put(0, torch.ones(4, 3))
    assert pool._last[0] is acts._host[0][1]
    acts.prefetch(0)
    loaded = acts._loaded[0]
    assert pool._last[0] is loaded
    assert torch.equal(acts.get(0), torch.ones(4, 3))


def test_copy_waits_are_read_as_they_finish_not_waited_for():
    """_CudaSpans.done_s: the spans whose end has completed, summed without blocking; the rest count later."""
    from megatrain.engine.runtime.stream import _CudaSpans

    class FakeEvent:
        def __init__(self, t: float) -> None:
            self.t, self.finished, self.blocked = t, False, False

        def query(self) -> bool:
            return self.finished

        def synchronize(self) -> None:
            self.blocked = True

        def elapsed_time(self, end: FakeEvent) -> float:
            return (end.t - self.t) * 1e3

    spans = _CudaSpans()
    a, b, c, d = FakeEvent(0.0), FakeEvent(0.5), FakeEvent(1.0), FakeEvent(3.0)
    spans.add(a, b)
    spans.add(c, d)
    b.finished = True
    assert spans.done_s() == 0.5 and not d.blocked  # the second span is still queued: not waited for
    d.finished = True
    assert spans.done_s() == 2.5
    assert not b.blocked and not d.blocked


def _batch(seq: int = 12):
    from conftest import make_batches

    b = make_batches(1, seq=seq)[0]
    b["position_ids"] = torch.arange(seq).expand(2, seq)
    return b


def test_a_device_batch_is_checked_without_reading_its_values_then():
    """On the device (meta stands in: any read of a value raises there) the checks are queued, not read."""
    from conftest import tiny_config

    from megatrain.engine.layer import batch as B

    cfg = tiny_config("llama")
    b = {k: v.to("meta") for k, v in _batch().items()}
    queued = []
    real = B.to_host
    B.to_host = lambda t: (queued.append(t), t)[1]
    try:
        pending = B.check_batch(cfg, b["input_ids"], b["attention_mask"], b["labels"], b["position_ids"], {})
    finally:
        B.to_host = real
    # the mask in one copy (for the attention's layout), the reductions in another: both queued from the device
    assert isinstance(pending, B.PendingCheck) and len(queued) == 2 and all(t.device.type == "meta" for t in queued)
    assert queued[0] is b["attention_mask"]  # first: it is read first (the layout, before the first layer)
    assert pending.keys[:2] == ["ids_min", "ids_max"]


def test_negative_control_reading_a_device_batchs_values_at_once_needs_the_device():
    from megatrain.engine.layer.batch import _read_values

    with pytest.raises((NotImplementedError, RuntimeError)):
        _read_values({"ids_min": torch.zeros((), device="meta", dtype=torch.long)})


def test_a_queued_check_reads_nothing_until_verified_and_refuses_the_same_batches(monkeypatch):
    from conftest import tiny_config
    from test_cuda_paths import _count_reads

    from megatrain.engine.layer.batch import check_batch

    cfg = tiny_config("llama")
    b = _batch()
    hits = _count_reads(monkeypatch, "cpu")
    pending = check_batch(cfg, b["input_ids"], b["attention_mask"], b["labels"], b["position_ids"], {}, defer=True)
    assert hits == []  # nothing read back at the check: each is a sync on a GPU
    pending.verify()
    assert hits == ["tolist"]  # all at once, when verified
    monkeypatch.undo()
    bad_ids = b["input_ids"].clone()
    bad_ids[1, 3] = cfg.vocab_size + 7
    bad_labels = b["labels"].clone()
    bad_labels[0, 5] = 10**6
    mask = b["attention_mask"].clone()
    mask[1] = 0
    cases = [((bad_ids, b["attention_mask"], b["labels"]), f"token id {cfg.vocab_size + 7}"),
             ((b["input_ids"], b["attention_mask"], bad_labels), "labels contain ids outside"),
             ((b["input_ids"], mask, b["labels"]), "masks every token")]
    for (ids, m, labels), msg in cases:
        with pytest.raises(ValueError, match=msg):
            check_batch(cfg, ids, m, labels, None, {})  # at once, in host memory
        pending = check_batch(cfg, ids, m, labels, None, {}, defer=True)
        with pytest.raises(ValueError, match=msg):
            pending.verify()


def test_sanitize_keeps_a_valid_batch_and_makes_a_bad_one_indexable():
    from conftest import tiny_config

    from megatrain.engine.layer.batch import check_batch

    cfg = tiny_config("llama")
    b = _batch()
    pending = check_batch(cfg, b["input_ids"], None, b["labels"], None, {}, defer=True)
    ids, labels = pending.sanitize(b["input_ids"], b["labels"])
    assert torch.equal(ids, b["input_ids"]) and torch.equal(labels, b["labels"])
    bad_ids, bad_labels = b["input_ids"].clone(), b["labels"].clone()
    bad_ids[0, 0], bad_labels[0, 2], bad_labels[1, 1] = cfg.vocab_size, -5, cfg.vocab_size
    ids, labels = pending.sanitize(bad_ids, bad_labels)
    assert 0 <= int(ids.min()) and int(ids.max()) < cfg.vocab_size
    assert labels[0, 2] == -100 and labels[1, 1] == -100


def test_the_engine_refuses_a_queued_bad_batch_before_the_device_indexes_it(monkeypatch):
    """The engine's forward with the checks queued (as for a device batch): a bad id is refused with the check's
    error, not an index fault (the CPU's IndexError stands in for the device's assert); a good batch gives the
    same loss bits as checked at once."""
    from conftest import tiny_model

    from megatrain.config import EngineConfig
    from megatrain.engine import Engine
    from megatrain.engine import engine as E
    from megatrain.engine.layer.batch import check_batch

    b = _batch()
    del b["position_ids"]
    eng = Engine(tiny_model("llama", layers=1), EngineConfig(device="cpu", compute_dtype="float32"))
    now = eng(**b).loss.detach()
    eng.zero_grad()
    monkeypatch.setattr(E, "check_batch", lambda *a, **k: check_batch(*a, **k, defer=True))
    assert torch.equal(eng(**b).loss.detach(), now)
    eng.zero_grad()
    bad = dict(b, input_ids=b["input_ids"].clone())
    bad["input_ids"][0, 4] = eng.hf_config.vocab_size + 1
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        eng(**bad)
    monkeypatch.setattr(E, "check_batch", lambda *a, **k: None)  # no check at all: the fault it prevents
    with pytest.raises(IndexError):
        eng(**bad)


def test_a_host_copy_waits_for_its_own_copy_not_the_device(monkeypatch):
    from megatrain.engine.runtime import host_copy

    log: list = []

    class FakeEvent:
        def record(self, stream=None) -> None:
            log.append(("record", stream))

        def synchronize(self) -> None:
            log.append("event sync")

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "compute")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("device sync"))
    monkeypatch.setattr(host_copy, "_pinned_empty", lambda shape, dtype: torch.empty(shape, dtype=dtype))
    ids = torch.tensor([[3, 1, 3]])
    copy = host_copy.HostCopy(ids)
    assert log == [("record", "compute")]  # queued on the stream the ids were computed on; nothing waited
    assert torch.equal(host_copy.host_value(copy), ids)
    assert log == [("record", "compute"), "event sync"]  # its own event only
    here = host_copy.to_host(ids)  # already in host memory: itself, nothing queued
    assert not isinstance(here, host_copy.HostCopy) and torch.equal(here, ids) and len(log) == 2
