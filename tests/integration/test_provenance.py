"""Provenance names the commit even where the tree has no .git (the GPU box gets a bare copy)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from megatrain.metrics.provenance import git_commit


def test_commit_from_env_outside_a_checkout(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MEGATRAIN_GIT_COMMIT", "abc123")
    assert git_commit(tmp_path) == ("abc123", False)
    monkeypatch.delenv("MEGATRAIN_GIT_COMMIT")
    assert git_commit(tmp_path) == ("unknown", False)


def test_checkout_wins_over_env(tmp_path: Path, monkeypatch) -> None:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True,
                              text=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "f").write_text("x")
    git("add", "f")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    monkeypatch.setenv("MEGATRAIN_GIT_COMMIT", "abc123")
    assert git_commit(tmp_path) == (git("rev-parse", "HEAD"), False)
    (tmp_path / "f").write_text("y")
    assert git_commit(tmp_path)[1] is True  # a modified tracked file makes the tree dirty
