"""``drafter.family: dflash2`` end to end on the tiny workspace: a few steps of training with a
validation kept as best, the export, and evaluation by the selector's walk, lossless."""

import csv
import json

import pytest
import torch
from conftest import run_stages, stopped_and_resumed

from dflash.commands.report import render_report

DFLASH2 = [
    "drafter.family=dflash2",
    "drafter.conv_group_size=8",
    "train.world_size=1",
    "train.epochs=1",
    "train.max_steps=3",
    "train.eval_every=2",
    "train.keep_best=true",
    "evaluate.num_prompts=2",
]


def test_dflash2_trains_exports_and_evaluates(tiny_workspace):
    run_stages(tiny_workspace, ["plan", "train", "evaluate"], DFLASH2)
    config = json.loads((tiny_workspace / "models/drafter/config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert config["dflash_config"]["conv_group_size"] == 8
    assert config["dflash_config"]["selector_top_k"] == 16
    rows = list(csv.DictReader(open(tiny_workspace / "plots/train/log.csv")))
    validated = [r for r in rows if r.get("val_path_accuracy")]
    assert validated and all(0 <= float(r["val_top_k_recall"]) <= 1 for r in validated)
    assert all(r["path_accuracy"] and r["top_k_oracle_tau"] for r in rows)
    details = json.loads((tiny_workspace / "metrics/train_details.json").read_text())
    last = rows[-1]
    for name in ("top_k_recall", "selector_accuracy", "path_accuracy", "top_k_oracle_tau"):
        assert details[f"final_{name}"] == pytest.approx(float(last[name])), name
    report = render_report(tiny_workspace)
    assert "path acc." in report and "oracle τ" in report
    metrics = json.loads((tiny_workspace / "metrics/eval_details.json").read_text())
    assert metrics["lossless_mismatches"] == 0 and metrics["n_prompts"] > 0
    assert metrics["baselines"]["untrained"]["lossless_mismatches"] == 0
    assert 1.0 <= metrics["acceptance_length"] <= 4.0


@pytest.mark.slow
def test_a_stopped_dflash2_run_resumes_to_the_same_drafter(
    tiny_workspace, tmp_path, monkeypatch, capsys
):
    """Stopped after checkpoint 3 and resumed in process, a DFlash 2 run (convs, selector and
    their optimizer state in the checkpoint) ends bitwise where an uninterrupted one does."""
    sets = ["drafter.family=dflash2", "drafter.conv_group_size=8", "train.world_size=1",
            "train.epochs=1", "train.checkpoint_every=3"]  # fmt: skip
    resumed = tmp_path / "resumed"
    whole, again = stopped_and_resumed(tiny_workspace, resumed, sets, monkeypatch, capsys)
    assert whole.keys() == again.keys() and any("candidate_selector" in k for k in whole)
    for name in whole:
        assert torch.equal(whole[name], again[name]), name
