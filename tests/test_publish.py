"""``python -m dflash.commands.publish DIR`` never destroys: a directory it did not write, the
workspace,
its pipeline directories and links are refused with exit 2, every file left as it was."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dflash.commands import publish
from dflash.eval.outputs import eval_headline
from dflash.metrics.schema import EvalDetails, partial
from dflash.model import hf_files
from dflash.model.card import SCORECARD_NOTE
from dflash.pipeline.fingerprint import path_digest
from dflash.pipeline.workspace import Workspace

WS = Workspace()
"""The workspace's paths relative to its root, as the stages run in it."""
SCORED_METRICS = publish.scored_metrics
"""The check the ``workspace`` fixture replaces, for the tests of the metrics themselves."""

EXPORT = {
    hf_files.CONFIG: "{}",
    hf_files.WEIGHTS: "weights",
    hf_files.REMOTE_CODE: "# code",
    hf_files.MODEL_CARD: f"# drafter\n{SCORECARD_NOTE}",
}


@pytest.fixture
def workspace(tmp_path, monkeypatch) -> Path:
    """A workspace (repository, DVC, target, data) with a drafter export that scored."""
    root = tmp_path / "work"
    for name in (".git", ".dvc", "models/target", "models/tokenizer", "data/raw"):
        (root / name).mkdir(parents=True)
        (root / name / "keep").write_text(name)
    (root / "dvc.yaml").write_text("stages: {}\n")
    (root / WS.drafter).mkdir(parents=True)
    for name, text in EXPORT.items():
        (root / WS.drafter / name).write_text(text)
    scored = partial(EvalDetails, {"n_prompts": 3})
    monkeypatch.setattr(publish, "scored_metrics", lambda root: scored)
    monkeypatch.chdir(root)
    return root


def snapshot(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def refused(capsys, out: str, words: str, root: Path) -> None:
    before = snapshot(root.parent)
    assert publish.main([out, "--root", str(root)]) == 2
    err = capsys.readouterr().err
    assert out in err and words in err and "Traceback" not in err
    assert snapshot(root.parent) == before


def test_publishes_into_an_absent_directory_then_over_its_own_publish(workspace):
    out = workspace.parent / "published"
    assert publish.main([str(out), "--root", str(workspace)]) == 0
    first = snapshot(out)
    assert "## Scorecard" in first[hf_files.MODEL_CARD].decode()
    (workspace / WS.drafter / hf_files.WEIGHTS).write_text("new weights")
    assert publish.main([str(out), "--root", str(workspace)]) == 0
    assert (out / hf_files.WEIGHTS).read_text() == "new weights"
    assert sorted(p.name for p in out.parent.iterdir()) == ["published", "work"]


def test_a_directory_holding_another_file_is_kept(workspace, capsys):
    out = workspace.parent / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    refused(capsys, str(out), "notes.txt", workspace)


def test_a_copy_of_an_export_that_was_never_published_is_kept(workspace, capsys):
    out = workspace.parent / "old_drafter"
    out.mkdir()
    for name, text in EXPORT.items():
        (out / name).write_text(text)
    refused(capsys, str(out), "not a previous publish", workspace)


@pytest.mark.parametrize(
    ("out", "words"),
    [
        ("models", "models/"),
        ("models/target", "models/"),
        ("data", "data/"),
        (".", "names no directory"),
        ("..", "names no directory"),
        ("WORKSPACE", "is the workspace"),
        ("PARENT", "is the workspace"),
    ],
)
def test_the_workspace_and_its_pipeline_dirs_are_refused(workspace, capsys, out, words):
    out = {"WORKSPACE": str(workspace), "PARENT": str(workspace.parent)}.get(out, out)
    refused(capsys, out, words, workspace)


def test_another_repository_is_refused(workspace, capsys):
    other = workspace.parent / "other"
    (other / ".git").mkdir(parents=True)
    refused(capsys, str(other), "holds .git", workspace)


def test_a_link_is_refused_and_its_target_kept(workspace, capsys):
    target = workspace.parent / "target"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    os.symlink(target, workspace.parent / "link")
    refused(capsys, str(workspace.parent / "link"), "symbolic link", workspace)


def test_leftover_scratch_beside_the_output_is_not_emptied(workspace, capsys):
    (workspace.parent / "published.old").mkdir()
    (workspace.parent / "published.old" / "notes.txt").write_text("mine")
    refused(capsys, str(workspace.parent / "published"), "notes.txt", workspace)


def test_the_published_copy_honours_the_umask(workspace):
    (workspace / WS.drafter / hf_files.WEIGHTS).chmod(0o600)  # as safetensors writes it
    old = os.umask(0o022)
    try:
        assert publish.main([str(workspace.parent / "published"), "--root", str(workspace)]) == 0
    finally:
        os.umask(old)
    files = (workspace.parent / "published").iterdir()
    assert {p.name: p.stat().st_mode & 0o777 for p in files} == dict.fromkeys(EXPORT, 0o644)


BASELINE = {"acceptance_length": 1.2, "acceptance_length_pooled": 1.2, "lossless_mismatches": 0,
            "speedup": 1.0}  # fmt: skip
EVAL_SET = {
    "acceptance_length": 2.5, "acceptance_length_ci95": [2.0, 3.0],
    "acceptance_length_pooled": 2.4, "acceptance_length_zlab": 2.6, "answer_cap_fraction": 0.0,
    "answer_loop_fraction": 0.0, "baselines": {"ngram": BASELINE, "untrained": BASELINE},
    "dflash_tokens_per_s": 9.0, "divergence_margins": [], "full_block_steps": 4,
    "generated_tokens": 40, "greedy_tokens_per_s": 5.0, "lossless_mismatches": 0,
    "modes": ["default"], "n_prompts": 3, "near_tie_divergences": 0,
    "per_position_acceptance": [0.5], "speedup": 1.8, "speedup_wall": 1.7, "strata": {},
    "target_forwards": 16,
    "records": {"prompts": 3, "records_read": 3, "skipped": {}},
}  # fmt: skip
"""A held-out split's figures, as evaluate writes them."""


@pytest.fixture
def scored(workspace, monkeypatch) -> Path:
    """The workspace with the train and evaluate metrics of its drafter, checked for real."""
    monkeypatch.setattr(publish, "scored_metrics", SCORED_METRICS)
    (workspace / "metrics").mkdir()
    (workspace / WS.train_metrics).write_text(json.dumps({"steps": 3}))
    details = {**EVAL_SET, "drafter_sha256": path_digest(workspace / WS.drafter), "sets": {}}
    (workspace / WS.eval_details).write_text(json.dumps(details))
    headline = eval_headline(EvalDetails.model_validate(details)).dump()
    (workspace / WS.eval_metrics).write_text(json.dumps(headline))
    return workspace


def refused_run(capsys, root: Path, words: str) -> None:
    out = root.parent / "published"
    assert publish.main([str(out), "--root", str(root)]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize("rel", [WS.eval_metrics, WS.eval_details])
def test_a_corrupt_wrong_typed_or_missing_metrics_file_is_refused(scored, capsys, rel):
    healthy = scored.parent / "healthy"
    assert publish.main([str(healthy), "--root", str(scored)]) == 0
    whole = (scored / rel).read_text()
    for bad in (whole[:50], "[1, 2, 3]", whole.replace('"n_prompts": 3', '"n_prompts": "3"')):
        (scored / rel).write_text(bad)
        refused_run(capsys, scored, f"{rel} is unreadable")
    (scored / rel).unlink()
    refused_run(capsys, scored, f"{rel} is missing")


def test_an_eval_json_of_another_evaluation_is_refused(scored, capsys):
    other = json.loads((scored / WS.eval_metrics).read_text()) | {"acceptance_length": 3.5}
    (scored / WS.eval_metrics).write_text(json.dumps(other))
    refused_run(capsys, scored, f"{WS.eval_metrics} does not match {WS.eval_details}")


def test_a_missing_drafter_is_named_missing(scored, capsys):
    for path in (scored / WS.drafter).iterdir():
        path.unlink()
    (scored / WS.drafter).rmdir()
    refused_run(capsys, scored, f"{WS.drafter} is missing")


def test_a_user_file_nested_in_a_previous_publish_is_kept(workspace, capsys):
    (workspace / WS.drafter / "extra").mkdir()
    (workspace / WS.drafter / "extra" / "shard.bin").write_text("export's")
    out = workspace.parent / "published"
    assert publish.main([str(out), "--root", str(workspace)]) == 0
    (out / "extra" / "mine.txt").write_text("mine")
    refused(capsys, str(out), "extra/mine.txt", workspace)
    (out / "extra" / "mine.txt").unlink()
    (out / "extra" / "deeper").mkdir()
    (out / "extra" / "deeper" / "mine.txt").write_text("mine")
    refused(capsys, str(out), "extra/deeper/mine.txt", workspace)
