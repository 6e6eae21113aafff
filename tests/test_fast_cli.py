"""The command line answers before torch loads: importing it, ``--help``, and a training run
refused because another one holds the workspace never import torch or transformers, which
take seconds (tens under load) to import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dflash.pipeline.lock import workspace_lock
from dflash.pipeline.workspace import Workspace

WS = Workspace()
"""The workspace's paths relative to its root, as the stages run in it."""

PARAMS = Path(__file__).resolve().parents[1] / "params.yaml"
HEAVY = "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"


def heavy_modules_after(code: str, cwd: Path) -> str:
    """Run ``code`` in a fresh interpreter; the heavy modules it left imported, and its stderr."""
    proc = subprocess.run(
        [sys.executable, "-c", f"import sys\n{code}\n{HEAVY}"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1] + proc.stderr


@pytest.mark.parametrize("module", ["dflash.cli", "dflash.commands.publish"])
def test_importing_the_command_line_loads_no_torch(tmp_path, module):
    assert heavy_modules_after(f"import {module}", tmp_path) == "[]"


def test_publish_help_and_refusal_load_no_torch(tmp_path):
    code = (
        "from dflash.commands import publish\n"
        "try:\n    publish.main(['--help'])\nexcept SystemExit:\n    pass\n"
        "assert publish.main(['.']) == 2"
    )
    out = heavy_modules_after(code, tmp_path)
    assert out.startswith("[]") and "names no directory" in out


def test_a_refused_second_training_run_loads_no_torch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = f"from dflash import cli\nassert cli.main(['train', '--params', {str(PARAMS)!r}]) == 2"
    with workspace_lock(WS.lock, "train"):
        out = heavy_modules_after(code, tmp_path)
    assert out.startswith("[]") and "`dflash train` (PID" in out
