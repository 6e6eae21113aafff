"""``evaluate`` and ``report`` notice a drafter that the last training run did not write."""

from __future__ import annotations

import json
from pathlib import Path

from dflash import cli
from dflash.commands.report import render_report
from dflash.model import hf_files
from dflash.pipeline.fingerprint import path_digest
from dflash.pipeline.freshness import stale_drafter
from dflash.pipeline.workspace import Workspace

WS = Workspace()
"""The workspace's paths relative to its root, as the stages run in it."""


def workspace(root: Path, train_json: dict | None) -> Path:
    (root / WS.drafter).mkdir(parents=True)
    (root / WS.drafter / hf_files.WEIGHTS).write_bytes(b"weights")
    (root / "params.yaml").write_text("data: {source: chitchat}\n")
    if train_json is not None:
        (root / WS.train_metrics).parent.mkdir(parents=True, exist_ok=True)
        (root / WS.train_metrics).write_text(json.dumps(train_json))
    return root


def test_a_drafter_without_train_json_is_stale(tmp_path):
    reason = stale_drafter(workspace(tmp_path, None))
    assert "metrics/train.json is missing" in reason and "did not finish" in reason


def test_a_drafter_with_another_digest_is_stale_and_the_recorded_one_is_not(tmp_path):
    root = workspace(tmp_path, {"steps": 3, "drafter_sha256": "0" * 64})
    digest = path_digest(root / WS.drafter)
    reason = stale_drafter(root)
    assert "is not the drafter the last training run wrote" in reason
    assert f"its digest begins {digest[:16]}" in reason  # both: the drafter's and the record's
    assert f"the one metrics/train.json records begins {'0' * 16}" in reason
    (root / WS.train_metrics).write_text(json.dumps({"drafter_sha256": digest}))
    assert stale_drafter(root) is None
    (root / WS.train_metrics).write_text(json.dumps({"steps": 3}))  # before digests: passes
    assert stale_drafter(root) is None


def test_evaluate_refuses_a_stale_drafter_with_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(workspace(tmp_path, None))
    assert cli.main(["evaluate"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "metrics/train.json is missing" in err
    assert "Traceback" not in err and not (tmp_path / WS.eval_metrics).exists()


def test_report_flags_a_stale_drafter_loudly(tmp_path):
    root = workspace(tmp_path, {"steps": 3, "drafter_sha256": "0" * 64})
    text = render_report(root).splitlines()
    end = next(i for i, line in enumerate(text) if line.endswith("!!!"))
    assert text[1].startswith("!!! models/drafter is not the drafter") and end >= 1
    assert all(len(line) <= 80 for line in text[1 : end + 1])  # wrapped, still one banner
    assert "!!!" not in render_report(workspace(tmp_path / "fresh", {"steps": 3}))
