"""The exact split master (engine/hilo.py): FP32 -> (bf16 hi, 16-bit lo, tie list) -> the same FP32 bits.

hi must be exactly the bf16 round-to-nearest-even of the value (it is the weight that streams), and the
round trip must give back every finite FP32 bit pattern. Negative controls: dropping the tie list or the
carry rule must break the round trip on the cases that need them.
"""

from __future__ import annotations

import torch

from megatrain.engine.hilo import join, split


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
