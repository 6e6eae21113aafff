"""DVCLive, opened the same way by every stage that logs to it."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any


def has_no_commits(directory: Path) -> bool:
    """Whether ``directory`` is inside a git repository that has no commit yet."""
    inside = subprocess.run(
        ["git", "rev-parse", "--is-inside-work-tree"], cwd=directory, capture_output=True
    )
    if inside.returncode != 0:
        return False
    head = subprocess.run(
        ["git", "rev-parse", "--verify", "-q", "HEAD"], cwd=directory, capture_output=True
    )
    return head.returncode != 0


def open_live(directory: Path) -> Any:
    """A DVCLive logger that never edits ``dvc.yaml`` (its outputs are declared there).

    DVCLive 3.49 reads ``HEAD`` when it starts and dies deep inside ``scmrepo`` in a git
    repository with no commit yet; that case gets a plain error saying what to do instead.
    """
    if has_no_commits(Path.cwd()):
        raise RuntimeError(
            "this git repository has no commit yet and DVCLive cannot start without one: "
            "commit once (git add -A && git commit -m init) and run again"
        )
    from dvclive import Live  # imports DVC: only when a stage logs

    return Live(str(directory), dvcyaml=None, save_dvc_exp=False, report=None)
