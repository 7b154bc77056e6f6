"""The exact split master (engine/host/hilo.py): FP32 -> (bf16 hi, 16-bit lo, tie list) -> the same FP32 bits.

hi must be exactly the bf16 round-to-nearest-even of the value (it is the weight that streams), and the
round trip must give back every finite FP32 bit pattern. Negative controls: dropping the tie list or the
carry rule must break the round trip on the cases that need them. The fast paths (a compiled kernel, torch
tiles) must give the first implementation's bits, kept here as the reference; wrong roundings are caught.
"""

from __future__ import annotations

import pytest
import torch

from megatrain.engine.host import hilo
from megatrain.engine.host.hilo import join, split


def _bits(values: list[int]) -> torch.Tensor:
    return torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in values], dtype=torch.int32)


def _round_trip(u: torch.Tensor, drop_ties: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    x = u.view(torch.float32)
    hi = torch.empty(x.numel(), dtype=torch.bfloat16)
    lo = torch.empty(x.numel(), dtype=torch.int16)
    ties = split(x, hi, lo)
    if drop_ties:
        ties = ties[:0]
    out = join(hi, lo, ties, torch.empty_like(x))
    return hi, out.view(torch.int32)


def _rne_reference(u: torch.Tensor) -> torch.Tensor:
    """bf16 RNE of FP32 bit patterns, as Python integers would do it (int64, no wrap-around)."""
    w = u.to(torch.int64) & 0xFFFFFFFF
    r = (w + 0x7FFF + ((w >> 16) & 1)) >> 16
    return r & 0xFFFF


def _check(u: torch.Tensor) -> None:
    x = u.view(torch.float32)
    nan = torch.isnan(x)
    hi, back = _round_trip(u)
    bad = (back != u) & ~nan
    assert not bad.any(), f"round trip changed {int(bad.sum())} values, e.g. {hex(int(u[bad][0]) & 0xFFFFFFFF)}"
    assert (back[nan] == 0x7FC00000).all(), "a NaN must come back as the canonical quiet NaN"
    hb = hi.view(torch.int16).to(torch.int64) & 0xFFFF
    assert torch.equal(hb[~nan], _rne_reference(u)[~nan]), "hi is not the bf16 RNE of the value"
    assert (hb[nan] == 0x7FC0).all()


def test_ten_million_random_bit_patterns_round_trip_exactly():
    gen = torch.Generator().manual_seed(15)
    for _ in range(2):
        u = torch.randint(-(2**31), 2**31, (5 * 10**6,), dtype=torch.int64, generator=gen).to(torch.int32)
        _check(u)


def test_edge_cases():
    uppers = [0x0000, 0x0001, 0x0002, 0x007F, 0x0080, 0x0081, 0x3F7F, 0x3F80, 0x3F81, 0x7F7E, 0x7F7F, 0x7F80,
              0x8000, 0x8001, 0x807F, 0x8080, 0xBF7F, 0xBF80, 0xFF7E, 0xFF7F, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81]
    lows = [0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFE, 0xFFFF]
    cases = [(up << 16) | lo for up in uppers for lo in lows]
    # largest finite values, smallest subnormals, ties of either parity and values that round to infinity
    cases += [0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x7F7E8000, 0x00000001, 0x80000001, 0x007FFFFF,
              0x00008000, 0x00018000, 0x80008000, 0x80018000, 0x3F808000, 0x3F818000, 0x7F800000, 0xFF800000]
    u = _bits(cases)
    _check(u)
    x = u.view(torch.float32)
    # infinities (and the values that round up to them) are carried exactly
    assert torch.equal(_round_trip(_bits([0x7F800000, 0xFF800000, 0x7F7FFFFF]))[1],
                       _bits([0x7F800000, 0xFF800000, 0x7F7FFFFF]))
    assert torch.isinf(x[-2:]).all()


def test_every_pattern_of_whole_binades():
    """Exhaustive over all 2^24 patterns whose upper halves are 0x3F80-0x3FFF and 0x8000-0x807F (normal
    numbers around 1, negative zero and subnormals): all low halves, every parity."""
    for base in (0x3F80, 0x8000):
        start = base << 16
        w = torch.arange(start, start + (1 << 23), dtype=torch.int64)
        _check(torch.where(w >= 1 << 31, w - (1 << 32), w).to(torch.int32))


def test_why_a_tie_list_the_negative_controls():
    # An even hi has 65537 FP32 preimages (upper = hi with lo 0..0x8000, upper = hi-1 with lo 0x8000..0xFFFF):
    # one more than 16 bits can name. Count them for hi = 0x3F80 (1.0).
    w = torch.arange(0x3F7F0000, 0x3F810000, dtype=torch.int64).to(torch.int32)
    hi = torch.empty(w.numel(), dtype=torch.bfloat16)
    split(w.view(torch.float32), hi, torch.empty(w.numel(), dtype=torch.int16))
    assert int((hi.view(torch.int16) == 0x3F80).sum()) == 65537
    # Without the tie list the odd-upper ties come back one ulp of bf16 too high; with it, exactly.
    tie_up = _bits([0x3F818000, 0x00018000, 0xBF7F8000])
    assert not torch.equal(_round_trip(tie_up, drop_ties=True)[1], tie_up)
    assert torch.equal(_round_trip(tie_up)[1], tie_up)
    # and even-upper ties (which RNE rounds down) need no entry
    tie_down = _bits([0x3F808000, 0x00008000])
    hi2, lo2 = torch.empty(2, dtype=torch.bfloat16), torch.empty(2, dtype=torch.int16)
    assert split(tie_down.view(torch.float32), hi2, lo2).numel() == 0


# -- the fast paths (compiled kernel, torch tiles) against the original formulas, bit for bit -------------

def _old_split(x: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The first implementation of split, kept here as the reference the fast paths must match."""
    u = x.reshape(-1).view(torch.int32)
    low = u & 0xFFFF
    up = u >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rne = up + ((low + 0x7FFF + (up & 1)) >> 16)
    hi.view(torch.int16).copy_(torch.where(nan, 0x7FC0, rne))
    low.masked_fill_(nan, 0)
    lo.copy_(low)
    return (((u & 0x1FFFF) == 0x18000) & ~nan).nonzero().flatten()


def _old_join(hi: torch.Tensor, lo: torch.Tensor, ties: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    low = lo.to(torch.int32) & 0xFFFF
    up = hi.view(torch.int16).to(torch.int32) - (low > 0x8000).to(torch.int32)
    u = out.view(torch.int32)
    u.copy_(up * 65536 + low)
    if ties.numel():
        u[ties] -= 65536
    return out


def _truncating_split(x: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """A deliberately wrong split (hi = the upper half, i.e. rounding toward zero): the negative control."""
    u = x.view(torch.int32)
    hi.view(torch.int16).copy_(u >> 16)
    lo.copy_(u)
    return torch.empty(0, dtype=torch.int64)


def _ties_away_split(x: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """Another wrong one: round half away from zero (every tie rounds up in magnitude)."""
    u = x.view(torch.int32)
    low, up = u & 0xFFFF, u >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    hi.view(torch.int16).copy_(torch.where(nan, 0x7FC0, up + ((low + 0x8000) >> 16)))
    lo.copy_(low.masked_fill(nan, 0))
    return (((u & 0xFFFF) == 0x8000) & ~nan).nonzero().flatten()


def _mixed_patterns(n: int, seed: int) -> torch.Tensor:
    """Random words with every hard class planted: ties of both parities, lo = 0x8000 +- 1, subnormals, both
    zeros, infinities, NaNs of every kind (quiet, signalling, negative), the carries into inf."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randint(-(2**31), 2**31, (n,), dtype=torch.int64, generator=gen)
    fixed = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF,
             0x7FBF8000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7E8000, 0x00000001, 0x80000001, 0x007FFFFF]
    w[: len(fixed)] = torch.tensor(fixed)
    k = n // 8
    up = torch.randint(0, 1 << 16, (4, k), generator=gen)
    w[len(fixed): len(fixed) + 4 * k] = torch.cat([(up[0] << 16) | 0x8000, (up[1] << 16) | 0x7FFF,
                                                    (up[2] << 16) | 0x8001,
                                                    torch.randint(0, 1 << 23, (k,), generator=gen) | (up[3] & 1) << 31])
    w = w[torch.randperm(n, generator=gen)]
    return torch.where(w >= 1 << 31, w - (1 << 32), w).to(torch.int32)


def _differences(u: torch.Tensor, split_fn) -> list[str]:
    """Where `split_fn` and the original formulas disagree (hi, lo, ties, the joined values): [] when none."""
    x, n = u.view(torch.float32), u.numel()
    h0, l0 = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.int16)
    t0 = _old_split(x.clone(), h0, l0)
    h1, l1 = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.int16)
    t1 = split_fn(x.clone(), h1, l1)
    bad = []
    if not torch.equal(h0.view(torch.int16), h1.view(torch.int16)):
        bad.append("hi")
    if not torch.equal(l0, l1):
        bad.append("lo")
    if not torch.equal(t0, t1):
        bad.append("ties")
    back0 = _old_join(h0, l0, t0, torch.empty(n)).view(torch.int32)
    back1 = join(h1, l1, t1, torch.empty(n)).view(torch.int32)
    if not torch.equal(back0, back1):
        bad.append("join")
    return bad


@pytest.fixture(params=["compiled", "torch", "torch-formula"])
def path(request, monkeypatch):
    """Each way split/join can run: the compiled kernel, torch ops (torch's bf16 conversion on NaN-free
    tiles), torch ops with only the integer formula (as where that conversion fails its self-check)."""
    if request.param == "compiled":
        # The test set-up has a C compiler (DeepSpeed's ops need one too): a kernel that fails to build is a failure
        # here, not a skip; where users have none, the torch paths below carry the same bits.
        assert hilo.kernel() is not None, "the hilo kernel did not build: is a C compiler (cc / gcc) on PATH?"
    else:
        monkeypatch.setattr(hilo._KERNEL, "state", None)
        monkeypatch.setattr(hilo, "_CHUNK", 1 << 14)  # many tiles, some with NaN, some without
        if request.param == "torch-formula":
            monkeypatch.setattr(hilo, "_torch_convert_ok", False)
    return request.param


def test_fast_paths_give_the_original_bits(path):
    for seed, n in ((0, 1_000_003), (1, 4097), (2, 37)):
        u = _mixed_patterns(n, seed)
        assert _differences(u, split) == [], (path, n)
    # a NaN-free tensor (torch's conversion on every tile) with many ties: more than one tie buffer's worth
    up = torch.randint(0, 0x7F00, (300_000,), generator=torch.Generator().manual_seed(3))
    u = ((up << 16) | 0x8000).to(torch.int32)
    assert _differences(u, split) == [], path
    # and a large one: the compiled path cuts it into one range per thread
    u = torch.randn(5_000_000, generator=torch.Generator().manual_seed(4)).view(torch.int32)
    assert _differences(u, split) == [], path


def test_split_poisons_the_scratch_it_reads(path):
    u = _mixed_patterns(100_003, 5)
    x = u.clone().view(torch.float32)
    hi, lo = torch.empty(x.numel(), dtype=torch.bfloat16), torch.empty(x.numel(), dtype=torch.int16)
    ties = split(x, hi, lo, poison=True)
    nan = torch.empty(x.numel()).fill_(float("nan"))
    assert torch.equal(x.view(torch.int32), nan.view(torch.int32)), "the scratch holds exactly what fill_(nan) writes"
    h0, l0 = torch.empty_like(hi), torch.empty_like(lo)
    assert torch.equal(ties, _old_split(u.view(torch.float32).clone(), h0, l0))
    assert torch.equal(hi.view(torch.int16), h0.view(torch.int16)) and torch.equal(lo, l0)


def test_negative_controls_wrong_rounding_is_caught():
    u = _mixed_patterns(200_003, 6)
    assert "hi" in _differences(u, _truncating_split)
    assert "hi" in _differences(u, _ties_away_split)
    # the ties-away variant only differs at even-upper ties: the planted ones must be what catches it
    ties_only = u[(u & 0xFFFF) != 0x8000]
    assert _differences(ties_only, _ties_away_split) == []


def test_no_compiler_falls_back_to_torch(monkeypatch):
    monkeypatch.setattr(hilo._KERNEL, "state", False)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert hilo.kernel() is None
    u = _mixed_patterns(10_007, 7)
    assert _differences(u, split) == []
    monkeypatch.setattr(hilo._KERNEL, "state", False)
    monkeypatch.delenv("CC")
    monkeypatch.setenv("MEGATRAIN_HILO_KERNEL", "torch")
    assert hilo.kernel() is None


def test_poisoning_context_tells_the_store_whether_the_split_filled():
    x = torch.randn(10_001)
    hi, lo = torch.empty(x.numel(), dtype=torch.bfloat16), torch.empty(x.numel(), dtype=torch.int16)
    with hilo.poisoning(x) as poisoned:
        split(x.clone(), hi, lo)  # another tensor: not poisoned
    assert not poisoned and not torch.isnan(x).any()
    with hilo.poisoning(x) as poisoned:
        split(x, hi, lo)
    assert poisoned and torch.isnan(x).all()
    y = torch.randn(10_001)
    split(y, hi, lo)  # outside the context: left as it is
    assert not torch.isnan(y).any()
