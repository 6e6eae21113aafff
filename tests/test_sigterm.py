"""SIGTERM mid-write: the stage or publish exits 143 and leaves no ``.tmp`` beside its outputs;
a stage says so in one line.

Each child blocks inside its atomic directory (a stand-in writer that writes, says so on
stdout, then waits), so the signal lands mid-write every time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dflash.fileio import SIGTERM_EXIT, exit_on_sigterm

BLOCK = """
import shutil, sys, time

def blocked(*args, **kwargs):
    out = next(a for a in args if hasattr(a, "mkdir"))
    (out / "partial").write_text("half")
    print("writing", flush=True)
    time.sleep(300)
"""


def terminate_mid_write(cwd: Path, script: str) -> subprocess.CompletedProcess:
    """Run ``script`` in ``cwd``, SIGTERM it once it is writing, and return how it ended."""
    code = BLOCK + textwrap.dedent(script)
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline() == "writing\n", child.stderr.read()
        child.send_signal(signal.SIGTERM)
        stdout, stderr = child.communicate(timeout=60)
    finally:
        child.kill()
    return subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)


def leftovers(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.tmp"))


def test_a_stage_killed_by_sigterm_removes_its_tmp_dir(tmp_path):
    (tmp_path / "data/raw").mkdir(parents=True)
    record = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    (tmp_path / "data/raw/in.jsonl").write_text(json.dumps(record) + "\n")
    (tmp_path / "params.yaml").write_text("data: {source: data/raw/in.jsonl}\n")
    (tmp_path / "data/ingested").mkdir()
    (tmp_path / "data/ingested/previous").write_text("kept")
    proc = terminate_mid_write(
        tmp_path,
        """
        from dflash import cli
        from dflash.stages import ingest
        ingest.ingest = lambda records, train, *rest: blocked(train.parent)
        sys.exit(cli.main(["ingest"]))
        """,
    )
    assert proc.returncode == SIGTERM_EXIT, proc.stderr
    assert proc.stderr.splitlines() == ["dflash ingest: terminated (SIGTERM); rerun to resume"]
    assert leftovers(tmp_path) == []
    assert [p.name for p in (tmp_path / "data/ingested").iterdir()] == ["previous"]


def test_publish_killed_by_sigterm_removes_its_tmp_dir(tmp_path):
    export = tmp_path / "work/models/drafter"
    export.mkdir(parents=True)
    (export / "README.md").write_text("# drafter\n")
    proc = terminate_mid_write(
        tmp_path,
        """
        import types
        from dflash.commands import publish
        publish.scored_metrics = lambda root: {}
        scorecard = types.SimpleNamespace(scorecard_rows=lambda metrics: [])
        sys.modules["dflash.eval.strata"] = scorecard  # the real one imports torch: seconds
        shutil.copytree = blocked
        sys.exit(publish.main(["published", "--root", "work"]))
        """,
    )
    assert proc.returncode == SIGTERM_EXIT, proc.stderr
    assert leftovers(tmp_path) == [] and not (tmp_path / "published").exists()


def test_the_handler_is_restored_after_the_block():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as ended, exit_on_sigterm():
        os.kill(os.getpid(), signal.SIGTERM)
    assert ended.value.code == SIGTERM_EXIT == 143
    assert signal.getsignal(signal.SIGTERM) == before
