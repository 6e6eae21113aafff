"""DVCLive starts where DVC runs, and says what to do where it cannot."""

from __future__ import annotations

import subprocess

import pytest

from dflash.metrics.dvclive import has_no_commits, open_live


def test_a_repository_without_commits_gets_a_plain_error(tmp_path, monkeypatch):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    monkeypatch.chdir(tmp_path)
    assert has_no_commits(tmp_path)
    with pytest.raises(RuntimeError, match="no commit yet"):
        open_live(tmp_path / "dvclive")


def test_outside_git_it_logs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert not has_no_commits(tmp_path)
    live = open_live(tmp_path / "dvclive")
    live.log_metric("loss", 1.0)
    live.end()
    assert (tmp_path / "dvclive" / "metrics.json").exists()
