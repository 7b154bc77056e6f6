"""The shared C build (engine/ckernel.py): its ISA flags follow torch's CPU capability, and a flag set the
compiler refuses falls back to the next one."""

import ctypes

import pytest
import torch

from megatrain.engine import ckernel

SOURCE = "int64_t twice(int64_t x) { return 2 * x; }\n"


def declare(lib: ctypes.CDLL) -> None:
    lib.twice.restype = ctypes.c_int64
    lib.twice.argtypes = [ctypes.c_int64]


needs_cc = pytest.mark.skipif(ckernel.compiler() is None, reason="no C compiler")


@needs_cc
def test_a_refused_flag_set_falls_back_to_the_next(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path))
    monkeypatch.setattr(ckernel, "arch_flags", lambda: [["-mno-such-flag-megatrain"], []])
    lib = ckernel.build("probe", SOURCE, declare, "MEGATRAIN_PROBE_KERNEL")
    assert lib is not None and lib.twice(21) == 42
    assert len(list((tmp_path / "kernels").glob("probe-*.so"))) == 1


@needs_cc
def test_every_flag_set_refused_means_no_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path))
    monkeypatch.setattr(ckernel, "arch_flags", lambda: [["-mno-such-flag-megatrain"], ["-mno-such-flag-either"]])
    assert ckernel.build("probe", SOURCE, declare, "MEGATRAIN_PROBE_KERNEL") is None


@pytest.mark.parametrize("capability, first", [("AVX512", "-mavx512f"), ("AVX2", "-mavx2"), ("DEFAULT", None)])
def test_flags_follow_torchs_capability(monkeypatch, capability, first):
    monkeypatch.setattr(ckernel.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    sets = ckernel.arch_flags()
    assert sets[-1] == []  # the baseline is always the last resort
    if first is None:
        assert sets == [[]]
    else:
        assert first in sets[0]
        assert "-mavx512f" not in sets[1]  # the next set down asks for less


def test_other_machines_build_for_the_baseline(monkeypatch):
    monkeypatch.setattr(ckernel.platform, "machine", lambda: "aarch64")
    assert ckernel.arch_flags() == [[]]
