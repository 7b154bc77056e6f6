"""One atomic write (megatrain/files/atomic.py): the target appears whole or not at all, and a failure keeps the
earlier file and leaves no temporary one behind."""

from __future__ import annotations

import pytest

from megatrain.files.atomic import atomic_path, atomic_write


def test_writes_text_and_bytes_and_makes_the_folder(tmp_path):
    assert atomic_write(tmp_path / "a" / "b.json", '{"x": 1}').read_text() == '{"x": 1}'
    assert atomic_write(tmp_path / "c.bin", b"\x00\x01", durable=True).read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a", "b.json", "c.bin"]


def test_a_failed_write_keeps_the_earlier_file_and_no_temporary(tmp_path):
    target = atomic_write(tmp_path / "state.json", "old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half a ne")
        raise RuntimeError("the writer died")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_the_target_is_never_seen_half_written(tmp_path):
    target = tmp_path / "f.txt"
    with atomic_path(target) as tmp:
        tmp.write_text("part")
        assert not target.exists()  # control: a plain write would already show the partial content here
    assert target.read_text() == "part"
