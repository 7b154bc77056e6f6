"""The slab norm over a fixed decomposition into chunks (engine/host/reduce_kernel.py CHUNK, slab_state.slab_norm):
the norm the reducer measures as a slab lands, on any number of threads, has the bits of the norm read from the
slab later, on any number of threads. Negative controls: torch's norm of the whole slab, and a split of the slab
by thread count, give other bits on the same data (what a reducer on several threads would otherwise report)."""

from __future__ import annotations

import threading

import pytest
import torch
from kit import bits, wide_range

from megatrain.engine.host import reduce_kernel as R
from megatrain.engine.host.slab_state import PartsAdd, SlabState, slab_norm

N = 100_000  # with a 4096-element chunk: 25 chunks, the last one short
CHUNK = 4096


@pytest.fixture
def lib(monkeypatch):
    k = R.kernel()
    assert k is not None, "the one-pass reducer did not build or did not match torch on its self-check"
    monkeypatch.setattr(R, "CHUNK", CHUNK)  # many chunks on a small slab; both the reducer and the reader take it
    return k


def _parts(g: torch.Tensor, cuts: list[int]) -> list[tuple[int, torch.Tensor]]:
    bounds = [*cuts, g.numel()]
    return [(a, g[a:b]) for a, b in zip(bounds, bounds[1:])]


def _on_thread(fn, threads: int):
    """Run fn() on a fresh thread whose torch team is `threads` (as the reducer's worker sets its own)."""
    from megatrain.engine.runtime.threads import set_team

    out: list = []

    def body() -> None:
        set_team(threads)
        out.append(fn())

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return out[0]


@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_norm_measured_as_the_slab_lands_is_the_norm_read_later_on_any_thread_count(lib, first, dtype):
    g = wide_range(N, 2).to(dtype)
    cuts = [0, 13, 4100, 4101, 60_003]  # parts that start inside chunks and span several
    measured, written = set(), set()
    for threads in (1, 2, 3, 7):
        slab = wide_range(N, 1)
        norm, finite = R.reduce_and_norm(lib, slab, _parts(g, cuts), first, threads)
        assert finite
        measured.add(int(bits(norm)))
        written.add(tuple(slab.view(torch.int32)[::997].tolist()))
        for read_threads in (1, 2):
            read = _on_thread(lambda s=slab: slab_norm(s), read_threads)
            assert int(bits(read)) == int(bits(norm)), (threads, read_threads)
    assert len(measured) == 1 and len(written) == 1  # independent of the reducer's thread count


@pytest.mark.parametrize("kind", ["one pass", "two passes"])
def test_the_slab_states_cached_norm_is_slab_norm_on_the_reducers_thread_count(lib, kind):
    """SlabState.reduce as the reducer's worker runs it (its own torch team): the one-pass kernel for a PartsAdd,
    torch's add then slab_norm for a plain add; the same bits either way, whatever the team."""
    g = wide_range(N, 3).to(torch.bfloat16)
    got = set()
    for threads in (1, 2, 4):
        slab = torch.zeros(N)
        state = SlabState(1)
        state.overwrite = True
        state.zero(0, slab)  # fresh: the reduction writes 0 + g

        def add(first: bool, slab=slab) -> None:
            torch.add(g, 0.0, out=slab) if first else slab.add_(g.float())

        adds = PartsAdd(add, _parts(g, [0, 77_777])) if kind == "one pass" else add
        _on_thread(lambda s=state, x=slab, a=adds: s.reduce(0, x, a, True), threads)
        cached = state.norm(0, slab)
        assert cached is not None and int(bits(cached)) == int(bits(slab_norm(slab)))
        got.add(int(bits(cached)))
    assert len(got) == 1


def test_both_paths_give_the_same_bits(lib):
    g = wide_range(N, 4).to(torch.bfloat16)
    one, two = torch.zeros(N), torch.zeros(N)
    norm, _ = R.reduce_and_norm(lib, one, [(0, g)], True, 3)
    torch.add(g, 0.0, out=two)
    assert torch.equal(one.view(torch.int32), two.view(torch.int32)) and int(bits(norm)) == int(bits(slab_norm(two)))


def test_the_chunks_split_over_the_threads_asked_for(lib, monkeypatch):
    submitted: list[int] = []
    pool = R._helpers()

    class Counting:
        @staticmethod
        def submit(fn, *a):
            submitted.append(1)
            return pool.submit(fn, *a)

    monkeypatch.setattr(R, "_helpers", lambda: Counting)
    for threads, helpers in [(1, 0), (3, 2), (64, R.chunks(N) - 1)]:  # never more threads than chunks
        submitted.clear()
        R.reduce_and_norm(lib, torch.zeros(N), [(0, wide_range(N, 5))], True, threads)
        assert len(submitted) == helpers, threads


def test_a_slab_of_one_chunk_keeps_torchs_norm_of_the_whole_slab(lib):
    x = wide_range(CHUNK, 6)
    assert int(bits(slab_norm(x))) == int(bits(torch.linalg.vector_norm(x)))
    slab = torch.zeros(CHUNK)
    norm, _ = R.reduce_and_norm(lib, slab, [(0, x)], True, 2)
    assert int(bits(norm)) == int(bits(torch.linalg.vector_norm(x)))
    assert float(slab_norm(torch.zeros(0))) == 0.0


def test_negative_control_whole_slab_and_per_thread_splits_give_other_bits(lib):
    """What the fixed decomposition rules out: torch's norm of the whole slab (what the reader took before) and a
    norm split by thread count differ from the chunked norm, and from each other, on this data."""
    x = wide_range(N, 1)
    chunked = int(bits(slab_norm(x)))
    assert int(bits(torch.linalg.vector_norm(x))) != chunked

    def by_threads(t: int) -> int:
        b = [N * j // t for j in range(t + 1)]
        parts = torch.stack([torch.linalg.vector_norm(x[p:q]) for p, q in zip(b, b[1:])])
        return int(bits(torch.linalg.vector_norm(parts)))

    assert len({by_threads(t) for t in (1, 2, 3)}) == 3


def test_a_chunk_that_is_not_a_multiple_of_8_is_refused(lib):
    with pytest.raises(ValueError, match="multiple of 8"):
        R.reduce_chunks(lib, torch.zeros(64), [(0, torch.ones(64))], True, 1, chunk=12)
