"""The node path's chunk fill (engine/parallel/node_path.py `fill`): a chunk of a layer's flat gradient layout, from
the per-parameter gradients, is the same as slicing the whole layout built at once, for every chunk of a map whose
chunks cut through parameters, with frozen weights (None) and the padding as zeros."""

from __future__ import annotations

import pytest
import torch

from megatrain.costs.shards import ShardMap
from megatrain.engine.parallel.node_path import fill


@pytest.mark.parametrize("sizes, frozen, world, chunk", [
    ([100, 37, 300, 5], {1}, 2, 128), ([64], set(), 2, 128), ([1000, 1000], {0}, 4, 256), ([7, 9], set(), 3, 192)])
def test_fill_equals_the_whole_layout_sliced(sizes, frozen, world, chunk):
    g = torch.Generator().manual_seed(0)
    grads = [None if i in frozen else torch.randn(n, generator=g).to(torch.bfloat16) for i, n in enumerate(sizes)]
    parts, at = [], 0
    for n, t in zip(sizes, grads):
        parts.append((at, at + n, t))
        at += n
    m = ShardMap.of(at, world, chunk, 64)
    whole = torch.zeros(m.padded, dtype=torch.float32)
    for (b, e, t) in parts:
        if t is not None:
            whole[b:e] = t.float()
    assert len(m.chunks()) > 1 or m.padded <= chunk
    for a, length in m.chunks():
        out = torch.full((length,), float("nan"))  # whatever the buffer held before: every element is written
        fill(out, a, parts)
        assert torch.equal(out, whole[a:a + length]), (a, length)
