"""The GPU check's pinning assertion (experiments/gpu_check/sync.py) holds the store to its design: pinned where
a DMA copy reads (stream sources, resident masters, staging), pageable where only host threads work (an FP32
master behind a bf16 shadow, the gradient slabs). Checked here with a recording Pinner in place of CUDA."""

from __future__ import annotations

import torch

from experiments.gpu_check.sync import pinning_expectations, pinning_report
from megatrain.engine.host.pinned import Pinner
from megatrain.engine.host.store import HostStore

LAYER = [("w", torch.Size([64, 32])), ("b", torch.Size([32]))]


def _store_and_pinned():
    ranges: list[tuple[int, int]] = []
    pinner = Pinner(register=lambda ptr, n: ranges.append((ptr, ptr + n)), unregister=lambda ptr: None)
    store = HostStore([LAYER, LAYER], [("emb", torch.Size([10, 32]))], pinner, torch.bfloat16)
    staging = [pinner.buffer(store.layers[0].numel, torch.bfloat16, "staging")]

    def is_pinned(t: torch.Tensor) -> bool:
        return any(a <= t.data_ptr() < b for a, b in ranges)

    return store, staging, is_pinned


def test_the_store_as_designed_passes_the_check():
    store, staging, is_pinned = _store_and_pinned()
    report = pinning_report(pinning_expectations(store, staging), is_pinned)
    assert report and all(report.values()), report


def test_negative_controls_a_missing_pin_and_a_needless_one_are_both_caught():
    store, staging, is_pinned = _store_and_pinned()
    expect = pinning_expectations(store, staging)
    unpinned_source = store.layers[1].stream_source
    report = pinning_report(expect, lambda t: is_pinned(t) and t is not unpinned_source)
    assert not report["layer_stream_sources"] and report["grad_slabs_pageable"]
    slab = store.layers[0].grad
    report = pinning_report(expect, lambda t: is_pinned(t) or t is slab)
    assert not report["grad_slabs_pageable"] and report["layer_stream_sources"]
    # what the old check asserted (masters and slabs pinned) is not what the store does
    assert not any(is_pinned(g.master) or is_pinned(g.grad) for g in store.layers)
