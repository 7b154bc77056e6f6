"""Crash-consistent checkpoint files: roundtrip, damage detection, the latest pointer, retention."""

from __future__ import annotations

import json
import os

import pytest
import torch
from kit import run_python
from safetensors import safe_open

from megatrain.run import checkpoint as ck


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(6, 5, generator=g)
    return {
        "w": torch.randn(3, 4, generator=g),
        "bf": torch.randn(7, generator=g).to(torch.bfloat16),
        "step": torch.tensor(3.0),
        "rng": torch.get_rng_state(),
        "ids": torch.arange(5, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 3),
        "strided": base.t(),  # non-contiguous
        "view_a": base[1],  # two views of one storage: safetensors.save_file would refuse these
        "view_b": base[2:4],
    }


def test_roundtrip_is_exact(tmp_path):
    t = _tensors()
    meta = {"global_steps": 4, "lr": [1e-3, 0.1], "nested": {"a": None, "b": "x"}, "inf": float("inf")}
    path = ck.save(tmp_path, "global_step4", t, meta)
    assert path == tmp_path / "global_step4"
    got, got_meta, got_path = ck.load(tmp_path)
    assert got_path == path
    assert got_meta == meta
    assert set(got) == set(t)
    for k in t:
        assert got[k].dtype == t[k].dtype and got[k].shape == t[k].shape
        assert torch.equal(got[k], t[k].contiguous()), k
    # The file is plain safetensors, readable by the reference implementation.
    with safe_open(str(path / ck.TENSORS_FILE), framework="pt") as f:
        assert set(f.keys()) == set(t)
        assert torch.equal(f.get_tensor("w"), t["w"])
    # Nothing temporary is left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step4", "latest"]


def test_latest_pointer_follows_saves(tmp_path):
    assert ck.latest_tag(tmp_path) is None
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        ck.load(tmp_path)
    ck.save(tmp_path, "a", {"x": torch.ones(2)}, {"i": 1})
    ck.save(tmp_path, "b", {"x": torch.full((2,), 2.0)}, {"i": 2})
    assert ck.latest_tag(tmp_path) == "b"
    assert (tmp_path / "latest").read_text() == "b"  # DeepSpeed's format: the bare tag
    assert ck.load(tmp_path)[1] == {"i": 2}
    assert ck.load(tmp_path, "a")[1] == {"i": 1}
    ck.save(tmp_path, "c", {"x": torch.ones(1)}, {"i": 3}, update_latest=False)
    assert ck.latest_tag(tmp_path) == "b"
    assert [t for _, t in ck.list_checkpoints(tmp_path)] == ["a", "b", "c"]


def test_same_tag_is_replaced(tmp_path):
    ck.save(tmp_path, "t", {"x": torch.zeros(3)}, {"v": 1})
    ck.save(tmp_path, "t", {"x": torch.ones(3)}, {"v": 2})
    tensors, meta, _ = ck.load(tmp_path, "t")
    assert meta == {"v": 2} and torch.equal(tensors["x"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "t"]


def _flip_byte(path, offset_from_end=3):
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("victim", [ck.TENSORS_FILE, ck.META_FILE])
def test_corrupted_file_is_named(tmp_path, victim):
    ck.save(tmp_path, "s1", _tensors(), {"k": "value"})
    _flip_byte(tmp_path / "s1" / victim)
    with pytest.raises(ck.CheckpointError, match=rf"{victim}: corrupt: sha256"):
        ck.load(tmp_path)


def test_truncated_file_is_named(tmp_path):
    ck.save(tmp_path, "s1", _tensors(), {})
    f = tmp_path / "s1" / ck.TENSORS_FILE
    size = f.stat().st_size
    os.truncate(f, size - 10)
    with pytest.raises(ck.CheckpointError, match=rf"{ck.TENSORS_FILE}: truncated.*{size - 10} bytes on disk, {size}"):
        ck.load(tmp_path, "s1")


def test_missing_file_and_manifest(tmp_path):
    ck.save(tmp_path, "s1", {"x": torch.ones(1)}, {})
    (tmp_path / "s1" / ck.META_FILE).unlink()
    with pytest.raises(ck.CheckpointError, match=rf"{ck.META_FILE}: missing"):
        ck.load(tmp_path)
    (tmp_path / "s1" / ck.MANIFEST_FILE).unlink()
    with pytest.raises(ck.CheckpointError, match="manifest missing"):
        ck.load(tmp_path)


def test_retention_keeps_newest(tmp_path):
    for i in range(5):
        ck.save(tmp_path, f"step{i}", {"x": torch.tensor([float(i)])}, {"i": i}, keep_last=2)
        alive = [t for _, t in ck.list_checkpoints(tmp_path)]
        assert alive == [f"step{j}" for j in range(max(0, i - 1), i + 1)]
    assert ck.load(tmp_path)[1] == {"i": 4}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_retention_never_deletes_latest(tmp_path):
    # The pointer names an older checkpoint (newer saves did not publish): pruning must spare it.
    ck.save(tmp_path, "good", {"x": torch.ones(1)}, {})
    ck.save(tmp_path, "n1", {"x": torch.ones(1)}, {}, update_latest=False)
    ck.save(tmp_path, "n2", {"x": torch.ones(1)}, {}, update_latest=False, keep_last=1)
    assert [t for _, t in ck.list_checkpoints(tmp_path)] == ["good", "n2"]
    assert ck.latest_tag(tmp_path) == "good"
    ck.load(tmp_path)


def test_crash_leftovers_are_invisible_and_cleaned(tmp_path):
    ck.save(tmp_path, "s1", {"x": torch.ones(2)}, {"i": 1})
    # A save that died before its rename: a temp dir with partial content.
    partial = tmp_path / f"{ck._TMP}{'0' * 32}-s2"
    partial.mkdir()
    (partial / ck.TENSORS_FILE).write_bytes(b"\0" * 10)
    # A save under an existing tag that died between moving the old copy away and landing the new.
    ck.save(tmp_path, "s0", {"x": torch.zeros(2)}, {"i": 0}, update_latest=False)
    moved = tmp_path / f"{ck._OLD}{'1' * 32}-s0"
    os.rename(tmp_path / "s0", moved)
    assert [t for _, t in ck.list_checkpoints(tmp_path)] == ["s1"]
    assert ck.load(tmp_path, "s0")[1] == {"i": 0}  # readers still find the old copy
    assert ck.load(tmp_path)[1] == {"i": 1}
    ck.save(tmp_path, "s3", {"x": torch.ones(2)}, {"i": 3})
    assert not partial.exists() and not moved.exists()
    assert [t for _, t in ck.list_checkpoints(tmp_path)] == ["s1", "s0", "s3"]


def test_bad_inputs(tmp_path):
    for tag in ["", "a/b", ".hidden", "latest", ".."]:
        with pytest.raises(ValueError, match="tag"):
            ck.save(tmp_path, tag, {}, {})
    with pytest.raises(TypeError, match="JSON-serializable"):
        ck.save(tmp_path, "x", {}, {"obj": object()})
    with pytest.raises(TypeError, match="'n' is a list"):
        ck.save(tmp_path, "x", {"n": [1, 2]}, {})
    with pytest.raises(ValueError, match="keep_last"):
        ck.save(tmp_path, "x", {}, {}, keep_last=0)
    assert not (tmp_path / "x").exists() and ck.latest_tag(tmp_path) is None
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(ck._TMP)]
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / ck.MANIFEST_FILE).write_text(json.dumps({"format": "other"}))
    with pytest.raises(ck.CheckpointError, match="not a megatrain.run.checkpoint manifest"):
        ck.load(tmp_path, "foreign")


# -- shard files (data-parallel saves: each rank writes its own optimizer state) --------------------------
def _sharded_save(root, tag, value: float, shard_ok: bool = True):
    tmp = ck.begin(root, tag)
    entry = ck.write_shard(tmp, f"{ck.SHARD_PREFIX}1.safetensors", {"optim.1.exp_avg": torch.full((4,), value)})
    if not shard_ok:
        entry = {**entry, "bytes": entry["bytes"] + 1}  # what a writer that lost its file would report
    return ck.publish(root, tag, tmp, {"optim.0.exp_avg": torch.full((2,), value)}, {"v": value},
                      shards={f"{ck.SHARD_PREFIX}1.safetensors": entry})


def test_shards_are_listed_read_and_checked(tmp_path):
    _sharded_save(tmp_path, "s1", 1.0)
    tensors, meta, path = ck.load(tmp_path)
    assert meta == {"v": 1.0} and set(tensors) == {"optim.0.exp_avg", "optim.1.exp_avg"}
    assert torch.equal(tensors["optim.1.exp_avg"], torch.full((4,), 1.0))
    tensors.close()
    shard = path / f"{ck.SHARD_PREFIX}1.safetensors"
    _flip_byte(shard)
    with pytest.raises(ck.CheckpointError, match=rf"{ck.SHARD_PREFIX}1.safetensors: corrupt"):
        ck.load(tmp_path)
    os.truncate(shard, shard.stat().st_size - 4)
    with pytest.raises(ck.CheckpointError, match=rf"{ck.SHARD_PREFIX}1.safetensors: truncated"):
        ck.load(tmp_path)


def test_a_save_whose_shard_is_not_whole_publishes_nothing(tmp_path):
    _sharded_save(tmp_path, "s1", 1.0)
    with pytest.raises(ck.CheckpointError, match="shard missing or not the size"):
        _sharded_save(tmp_path, "s2", 2.0, shard_ok=False)
    assert ck.latest_tag(tmp_path) == "s1" and [t for _, t in ck.list_checkpoints(tmp_path)] == ["s1"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # its temp directory is gone
    assert ck.load(tmp_path)[1] == {"v": 1.0}


def test_a_shard_writer_killed_mid_write_leaves_the_previous_checkpoint(tmp_path):
    """A real process dies (SIGKILL) while writing its shard into a save's temp directory: the previous
    checkpoint stays the one `latest` names and loads; the next save clears the leftovers."""
    import signal
    import textwrap

    _sharded_save(tmp_path, "s1", 1.0)
    tmp = ck.begin(tmp_path, "s2")
    code = textwrap.dedent(f"""
        import os, signal, torch
        from megatrain.run import checkpoint as ck
        real = os.fsync
        os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)  # dies with the shard's bytes unsynced
        ck.write_shard({str(tmp)!r}, "{ck.SHARD_PREFIX}1.safetensors", {{"optim.1.exp_avg": torch.ones(1 << 16)}})
    """)
    r = run_python(["-c", code], timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    assert (tmp / f"{ck.SHARD_PREFIX}1.safetensors").exists()  # it did die mid-save
    assert ck.latest_tag(tmp_path) == "s1" and [t for _, t in ck.list_checkpoints(tmp_path)] == ["s1"]
    assert ck.load(tmp_path)[1] == {"v": 1.0}
    _sharded_save(tmp_path, "s3", 3.0)
    assert not tmp.exists() and ck.load(tmp_path)[1] == {"v": 3.0}
