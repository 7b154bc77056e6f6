"""The engine's fixed mmap threshold (engine/runtime/malloc.py): freed host transients leave the resident set."""

from __future__ import annotations

import json
import platform

import pytest
from kit import run_python

from megatrain.config.schema import EngineConfig
from megatrain.engine.runtime.malloc import MAX_MMAP_THRESHOLD, set_mmap_threshold

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator only")

# In a fresh process: free one large block (glibc's dynamic threshold rises to its size), optionally
# fix the threshold, then allocate a 4 MiB transient with a small block after it (so it is not at the top
# of the heap, which glibc trims anyway), touch it, free it, and report how much of it stayed resident.
_PROBE = r"""
import json, sys, psutil, torch
from megatrain.engine.runtime.malloc import set_mmap_threshold
big = torch.ones(16 * 2**20 // 4); del big
applied = set_mmap_threshold(int(sys.argv[1])) if sys.argv[1] != "none" else None
proc = psutil.Process()
before = proc.memory_info().rss
transient = torch.ones(4 * 2**20 // 4)
after_top = torch.ones(1024)
del transient
print(json.dumps({"retained": proc.memory_info().rss - before, "applied": applied}))
"""


def _retained(threshold: str) -> dict:
    out = run_python(["-c", _PROBE, threshold], check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_fixed_threshold_returns_a_freed_transient_and_the_default_keeps_it():
    fixed = _retained(str(128 * 1024))
    assert fixed["applied"] is True
    assert fixed["retained"] < 1 * 2**20, fixed
    # negative control: glibc's dynamic threshold (raised to 16 MiB by the first free) keeps the 4 MiB
    dynamic = _retained("none")
    assert dynamic["retained"] > 3 * 2**20, dynamic


def test_threshold_out_of_glibc_range_is_refused():
    with pytest.raises(ValueError, match="mmap threshold"):
        set_mmap_threshold(MAX_MMAP_THRESHOLD + 1)
    with pytest.raises(ValueError, match="host_mmap_threshold_bytes"):
        EngineConfig(host_mmap_threshold_bytes=0)
    with pytest.raises(ValueError, match="host_mmap_threshold_bytes"):
        EngineConfig(host_mmap_threshold_bytes=True)
    assert EngineConfig(host_mmap_threshold_bytes=None).host_mmap_threshold_bytes is None
