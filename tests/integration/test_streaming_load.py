"""Loads stream: load_checkpoint (fp32 and hilo host masters) and an HF directory grow peak RSS by at most 10%
of the FP32 masters beyond what the loaded run must hold (a fresh run: its optimizer state), parameters and
optimizer state bit-identical with the saving process. The readers used before (safetensors' mmap-backed
load_file / safe_open) are measured the same way and must exceed the bound: the negative controls.

Each measurement runs in a process of its own (tests/workers/load_rss_worker.py); a ~27M-parameter model keeps the
bound (~11 MB) well above the measurement's noise.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from kit import run_python, worker_env

from megatrain.files.tensor_file import TensorFile

WORKER = Path(__file__).resolve().parents[1] / "workers" / "load_rss_worker.py"
SHAPE = ("8", "512", "2048")  # layers, hidden, vocab: the largest tensor (the embedding) is ~4% of the masters
BOUND = 0.10


def _run(*args: str) -> dict:
    r = run_python([WORKER, *args], env=worker_env(path=[WORKER.parent.parent]), timeout=600, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("streaming")
    return d, _run("save", str(d), "hilo", *SHAPE)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["hilo", "fp32"])
def test_load_checkpoint_streams(saved, mode):
    d, ref = saved
    got = _run("ckpt", str(d), mode, *SHAPE)
    masters = got["masters_fp32"]
    assert got["digest"] == ref["digest"] and got["reload_digest"] == ref["digest"]  # bit-identical, both loads
    fresh_excess = got["fresh"][0] - got["needed"]
    assert fresh_excess <= BOUND * masters, f"fresh load: {fresh_excess / masters:.1%} of the FP32 masters"
    assert got["reload"][0] <= BOUND * masters, f"reload: {got['reload'][0] / masters:.1%} of the FP32 masters"
    # negative control: the mapped whole-file reader holds the file's touched pages while its tensors live
    assert got["reload_mapped"][0] > BOUND * masters, got


@pytest.mark.slow
def test_hf_directory_streams(saved):
    d, ref = saved
    got = _run("hf", str(d), "hilo", *SHAPE)
    masters = got["masters_fp32"]
    assert got["weights_digest"] == got["hf_weights_digest"] == ref["weights_digest"]
    assert got["hf"][0] <= BOUND * masters, f"HF load: {got['hf'][0] / masters:.1%} of the FP32 masters"
    assert got["hf_mapped"][0] > BOUND * masters, got  # negative control: safe_open's mapping
    assert got["hf_mapped_weights_digest"] == ref["weights_digest"]


def test_tensor_file_reads_into_place_and_converts(tmp_path):
    from megatrain.run.checkpoint import write_safetensors

    t = {"a": torch.arange(12, dtype=torch.float32).view(3, 4), "b": torch.arange(5, dtype=torch.bfloat16),
         "empty": torch.zeros(0, 2)}
    write_safetensors(tmp_path / "x.safetensors", t)
    with TensorFile(tmp_path / "x.safetensors") as f:
        assert list(f) == ["a", "b", "empty"] and f.shape("a") == (3, 4) and f.dtype("b") == torch.bfloat16
        dest = torch.full((3, 4), -1.0)
        assert f.read_into("a", dest) is dest and torch.equal(dest, t["a"])  # in place
        wide = torch.empty(5, dtype=torch.float32)
        assert torch.equal(f.read_into("b", wide), t["b"].float())  # converted
        assert torch.equal(f["empty"], t["empty"]) and torch.equal(f.read_transient("a"), t["a"])
        with pytest.raises(ValueError, match="shape"):
            f.read_into("a", torch.empty(4, 3))
        with pytest.raises(KeyError, match="no tensor 'c'"):
            f["c"]
    # a truncated file is reported by name, not read as zeros
    raw = (tmp_path / "x.safetensors").read_bytes()
    (tmp_path / "y.safetensors").write_bytes(raw[:-20])
    with TensorFile(tmp_path / "y.safetensors") as f, pytest.raises(ValueError, match="truncated"):
        f.read_into("b", torch.empty(5, dtype=torch.bfloat16))
