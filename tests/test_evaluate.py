"""Evaluate stage: real speculative decoding of held-out prompts, lossless by construction."""

from __future__ import annotations

import csv
import json

import pytest
from conftest import run_stages

from dflash.eval.evaluate import PromptResult, acceptance_by_position, summarize


def test_acceptance_by_position_counts_drafts_not_the_bonus_token():
    # Steps committing 1 (bonus only), 3 (2 drafts + bonus) and 4 tokens, block size 4.
    assert acceptance_by_position([1, 3, 4], 4) == pytest.approx([2 / 3, 2 / 3, 1 / 3])


def test_summary_counts_mismatches_and_pools_acceptance():
    results = [
        PromptResult(accepted=[2, 2], mismatch=False, n_tokens=5, greedy_s=1.0, dflash_s=0.5),
        PromptResult(accepted=[4], mismatch=True, n_tokens=5, greedy_s=1.0, dflash_s=0.5),
    ]
    metrics = summarize(results, block_size=4)
    assert metrics["acceptance_length"] == pytest.approx(8 / 3)
    assert metrics["lossless_mismatches"] == 1
    assert metrics["speedup"] == pytest.approx(2.0)


def test_evaluate_stage_on_a_trained_tiny_drafter(tiny_workspace):
    single = ["train.world_size=1", "train.epochs=1"]
    run_stages(tiny_workspace, ["plan", "train", "evaluate"], single)
    metrics = json.loads((tiny_workspace / "metrics/eval.json").read_text())
    assert metrics["lossless_mismatches"] == 0
    assert metrics["n_prompts"] > 0
    assert 1.0 <= metrics["acceptance_length"] <= 4.0
    assert len(metrics["per_position_acceptance"]) == 3
    rows = list(csv.DictReader(open(tiny_workspace / "plots/eval/acceptance.csv")))
    assert [int(r["position"]) for r in rows] == [1, 2, 3]
