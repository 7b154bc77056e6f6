"""Backward's one-pass reduction (engine/host/reduce_kernel.py): the gradient added into (or, the first time after
zero_grad, written to) the FP32 slab and the slab's norm measured in the same loop, with the bits of the two torch
passes it replaces (add, then torch.linalg.vector_norm); the engine-level bit-identity is the landed-norm and
engine tests', which run this pass on this machine (two threads)."""

from __future__ import annotations

import pytest
import torch
from kit import bits, wide_range

from megatrain.engine.host import reduce_kernel as R
from megatrain.engine.host.slab_state import PartsAdd, SlabState


@pytest.fixture
def lib():
    # The test set-up has a C compiler (DeepSpeed's ops need one too): a kernel that fails to build or to match the
    # two torch passes is a failure here, not a skip; where users have none, the reducer keeps those passes.
    k = R.kernel()
    assert k is not None, "the one-pass reducer did not build or did not match add + vector_norm on its self-check"
    return k


def _values(n: int, seed: int) -> torch.Tensor:
    x = wide_range(n, seed)
    x[::97] = -0.0
    return x


@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,cuts", [(8, [0]), (4096, [0, 5, 1003]), (1 << 18, [0, 77777]), (24, [0, 8, 8, 16])])
def test_the_pass_gives_the_bits_of_add_then_vector_norm(lib, first, dtype, n, cuts):
    base, g = _values(n, 1), _values(n, 2).to(dtype)
    want = base.clone()
    if first:
        torch.add(g, 0.0, out=want)  # what the reducer's first add writes: 0 + g (a -0 lands as +0)
    else:
        want.add_(g.float())
    got = base.clone()
    bounds = [*cuts, n]
    norm, finite = R.reduce_and_norm(lib, got, [(a, g[a:b]) for a, b in zip(bounds, bounds[1:])], first)
    assert torch.equal(bits(got), bits(want))
    assert torch.equal(bits(norm), bits(torch.linalg.vector_norm(want))) and finite


def test_a_non_finite_value_written_is_flagged(lib):
    slab, g = torch.zeros(64), torch.ones(64)
    g[37] = float("inf")
    norm, finite = R.reduce_and_norm(lib, slab, [(0, g)], False)
    assert not finite and norm.isinf()


def test_negative_control_lanes_summed_in_another_order_fail_the_self_check(lib):
    class Wider:  # the same loop, its lanes added in double: not torch's order
        reduce_range = lib.reduce_range

        @staticmethod
        def finish_norm(ptr: int) -> float:
            import ctypes

            lanes = (ctypes.c_float * R.LANES).from_address(ptr)
            return float(torch.tensor(list(lanes), dtype=torch.float64).sum().sqrt())

    assert R._matches_torch(lib) and not R._matches_torch(Wider)


def test_the_slab_state_takes_the_pass_only_for_a_parts_add(lib, monkeypatch):
    calls: list[int] = []
    run = R.reduce_and_norm
    monkeypatch.setattr(R, "reduce_and_norm", lambda *a: (calls.append(1), run(*a))[1])
    g = _values(1024, 3).to(torch.bfloat16)
    for add_kind, n, want_calls in [("parts", 1024, 1), ("plain", 1024, 0), ("parts", 1020, 0)]:
        calls.clear()
        slab, ref = torch.zeros(n), torch.zeros(n)
        state = SlabState(1)

        def add(first: bool, slab=slab, n=n) -> None:
            slab.add_(g[:n].float())

        adds = PartsAdd(add, [(0, g[:n])]) if add_kind == "parts" else add
        before = slab._version
        state.reduce(0, slab, adds, True)
        ref.add_(g[:n].float())
        assert len(calls) == want_calls, (add_kind, n)  # a slab not a multiple of 8 keeps the torch passes
        assert torch.equal(bits(slab), bits(ref)) and slab._version > before
        assert torch.equal(bits(state.norm(0, slab)), bits(torch.linalg.vector_norm(ref)))


def test_the_pass_is_taken_on_any_thread_count():
    # its chunks split over the reducer's threads (test_chunked_norm.py): it pays on many cores too
    assert R.pays(1) and R.pays(2) and R.pays(3) and R.pays(28) and R.pays(None)


def test_the_kernel_is_built_with_the_engine(monkeypatch):
    from conftest import tiny_model

    from megatrain.config.schema import EngineConfig
    from megatrain.engine import Engine

    monkeypatch.setattr(R._KERNEL, "state", False)  # not tried yet in this process
    Engine(tiny_model("llama", layers=2), EngineConfig(device="cpu", parity_probe=False))
    assert R._KERNEL.state is not False, "the kernel was left to the first backward"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_streamed_first_write_gives_the_plain_writesbits(lib, dtype):
    # Parts cut off the 8-blocks (the scalar head and tail around the streamed body), a slab view off its 32-byte
    # alignment (the plain stores then), several chunks on two threads.
    n = 3 * (1 << 16) + 40
    g = _values(n, 3).to(dtype)
    parts = [(0, g[:13]), (13, g[13:70001]), (70001, g[70001:])]
    for off in (0, 4):  # a slab that starts off a 32-byte boundary as well
        plain, streamed = torch.full((n + off,), 7.0)[off:], torch.full((n + off,), 7.0)[off:]
        a = R.reduce_chunks(lib, plain, parts, True, 2, chunk=1 << 16, stream=False)
        b = R.reduce_chunks(lib, streamed, parts, True, 2, chunk=1 << 16, stream=True)
        assert torch.equal(bits(streamed), bits(plain)) and torch.equal(bits(b.norms), bits(a.norms))
        assert torch.equal(bits(plain), bits(torch.add(g.float(), 0.0)))  # 0 + g, written over what was there


class _Spy:
    """The kernel, recording the `first` argument of each reduce_range call (2: streamed stores)."""

    def __init__(self, lib) -> None:
        self.lib, self.modes = lib, []

    def __getattr__(self, name: str):
        return getattr(self.lib, name)

    def reduce_range(self, *args):
        self.modes.append(args[5])
        return self.lib.reduce_range(*args)


class _NoStreams(_Spy):
    """The kernel as a build without streaming stores reports itself (no AVX)."""

    def streamed(self) -> int:
        return 0


@pytest.mark.parametrize("build", ["this", "no-avx"])
def test_only_a_first_write_of_a_large_slab_streams(lib, build):
    # A build without streaming stores writes even a large first write plainly (mode 1); this machine's build is
    # checked as it is, and the other kind through its report, so neither case is skipped.
    lib = lib if build == "this" else _NoStreams(lib)
    big, small = torch.zeros(R.STREAM_MIN), torch.zeros(R.STREAM_MIN - 8)
    g = torch.ones(R.STREAM_MIN)
    large_first = 2 if lib.streamed() else 1
    for slab, first, mode in [(big, True, large_first), (big, False, 0), (small, True, 1)]:  # the latter two: controls
        spy = _Spy(lib)
        R.reduce_chunks(spy, slab, [(0, g[: slab.numel()])], first, 1)
        assert set(spy.modes) == {mode}, (slab.numel(), first, spy.modes)
        assert torch.equal(slab, g[: slab.numel()] * (1 if first else 2))


@pytest.mark.parametrize("residency", ["auto", "stream"])  # the device slab on this thread, and the reducer's
def test_an_engine_whose_slabs_stream_trains_bit_for_bit_as_one_whose_do_not(lib, monkeypatch, residency):
    # A tiny model's slabs are far below STREAM_MIN: lowered, every first write streams. Two micro-batches per step
    # (a streamed first write, then an add), clipped (the measured norms read), two steps.
    import copy

    from conftest import make_batches, tiny_model
    from kit import adam_state, train_steps

    from megatrain.config.schema import EngineConfig
    from megatrain.engine import Engine

    model, batches = tiny_model("llama", layers=3), make_batches(4)
    modes = []
    run = R.reduce_chunks

    def spy(lib, slab, parts, first, *a, **k):
        modes.append(R.streams(lib, slab, first) if k.get("stream") is None else k["stream"])
        return run(lib, slab, parts, first, *a, **k)

    monkeypatch.setattr(R, "reduce_chunks", spy)
    out = {}
    for stream_min in (8, 1 << 40):
        monkeypatch.setattr(R, "STREAM_MIN", stream_min)
        modes.clear()
        eng = Engine(copy.deepcopy(model), EngineConfig(device="cpu", compute_dtype="float32", residency=residency),
                     optimizer=lambda named: torch.optim.AdamW([p for _, p in named], lr=1e-2, fused=True))
        losses, norms = train_steps(eng, iter(batches), 2, accum=2, clip=0.05)
        out[stream_min] = (losses, norms, [p.detach().clone() for _, p in eng.named_parameters()], adam_state(eng))
        assert any(modes) == (stream_min == 8), modes  # the run streamed, the control did not
    (la, na, wa, sa), (lb, nb, wb, sb) = out[8], out[1 << 40]
    assert la == lb and na == nb
    assert all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(wa, wb))
    assert all(torch.equal(x, y) for x, y in zip(sa, sb))
