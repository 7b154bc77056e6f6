"""Provenance names the commit even where the tree has no .git (the GPU box gets a bare copy)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from megatrain.metrics.provenance import git_commit


def test_commit_from_env_outside_a_checkout(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MEGATRAIN_GIT_COMMIT", "abc123")
    assert git_commit(tmp_path) == ("abc123", False)
    monkeypatch.delenv("MEGATRAIN_GIT_COMMIT")
    assert git_commit(tmp_path) == ("unknown", False)


def test_checkout_wins_over_env(monkeypatch) -> None:
    if shutil.which("git") is None or not (Path(__file__).resolve().parents[1] / ".git").exists():
        pytest.skip("needs a git checkout")
    repo = Path(__file__).resolve().parents[1]
    monkeypatch.setenv("MEGATRAIN_GIT_COMMIT", "abc123")
    sha, _ = git_commit(repo)
    assert sha != "abc123" and len(sha) == 40
