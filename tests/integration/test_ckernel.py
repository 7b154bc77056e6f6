"""The shared C build (engine/runtime/ckernel.py): its ISA flags follow torch's CPU capability, and a flag set the
compiler refuses falls back to the next one."""

import sys

import pytest
import torch

from megatrain.engine.runtime import ckernel

SOURCE = "int64_t twice(int64_t x) { return 2 * x; }\n"
# A stand-in compiler (no C compiler needed): refuses any flag starting with -mno-such, else writes its
# arguments where -o points, so a test reads back which flags built the object.
FAKE_CC = """
import sys
args = sys.argv[1:]
if args == ["--version"]:
    print("fakecc 1.0")
elif any(a.startswith("-mno-such") for a in args):
    sys.exit("fakecc: unrecognized option")
else:
    open(args[args.index("-o") + 1], "w").write(" ".join(args))
"""


@pytest.fixture
def fake_cc(tmp_path, monkeypatch):
    script = tmp_path / "fakecc.py"
    script.write_text(FAKE_CC)
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", f"{sys.executable} {script}")
    return ckernel.compiler()


def test_a_refused_flag_set_falls_back_to_the_next(fake_cc, monkeypatch):
    monkeypatch.setattr(ckernel, "arch_flags", lambda: [["-mno-such-flag"], ["-mavx2"], []])
    built = ckernel._compile("probe", SOURCE, fake_cc).read_text().split()
    assert "-mavx2" in built and "-mno-such-flag" not in built
    assert [p.name.startswith("probe-") for p in (ckernel.cache_dir()).iterdir()] == [True]  # only what built


def test_every_flag_set_refused_means_no_kernel(fake_cc, monkeypatch):
    monkeypatch.setattr(ckernel, "arch_flags", lambda: [["-mno-such-flag"], ["-mno-such-either"]])
    assert ckernel.build("probe", SOURCE, lambda lib: None, "MEGATRAIN_PROBE_KERNEL") is None


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


def test_every_kernel_source_is_a_c_file_shipped_as_package_data():
    # One loader (ckernel.LazyKernel) over .c files: no C left inside Python strings, and the files are in the
    # package data a wheel carries.
    import fnmatch
    import re
    from pathlib import Path

    import tomllib

    from megatrain.engine.runtime import ckernel

    root = Path(ckernel.__file__).resolve().parents[3]
    sources = sorted(p.name for p in ckernel.SOURCES.glob("*.c"))
    assert sources == ["adam.c", "hilo.c", "reduce.c"]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["megatrain"]
    for name in sources:
        rel = f"engine/runtime/kernels/{name}"
        assert any(fnmatch.fnmatch(rel, p) for p in patterns), (rel, patterns)
    embedded = [p for p in (root / "megatrain").rglob("*.py") if re.search(r'r"""\s*(#include|/\*|int64_t|void )',
                                                                           p.read_text())]
    assert embedded == []
