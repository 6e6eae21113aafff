"""Evaluate stage: τ as the field reports it, baselines through the same verifier, lossless."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from conftest import run_stages

from dflash.eval.length_loss import loss_by_tercile
from dflash.eval.loops import ends_in_loop, text_ends_in_loop
from dflash.eval.metrics import (
    acceptance_by_position,
    bootstrap_interval,
    summarize_method,
)
from dflash.eval.ngram import ngram_lookup
from dflash.model.generate import GenerateOutput


def out(accepted, full=None, decode_s=1.0, prefill_s=0.0) -> GenerateOutput:
    full = [True] * len(accepted) if full is None else full
    tokens = [0] * (1 + sum(accepted))
    return GenerateOutput(tokens, accepted, full, accepted, prefill_s=prefill_s, decode_s=decode_s)


def test_acceptance_by_position_counts_drafts_not_the_bonus_token():
    # Steps committing 1 (bonus only), 3 (2 drafts + bonus) and 4 tokens, block size 4.
    assert acceptance_by_position([out([1, 3, 4])], 4) == pytest.approx([2 / 3, 2 / 3, 1 / 3])


def test_acceptance_by_position_leaves_out_blocks_cut_short():
    # The last step could verify only 2 slots (budget) or ended at a stop token.
    cut = out([4, 2], full=[True, False])
    assert acceptance_by_position([cut], 4) == pytest.approx([1.0, 1.0, 1.0])


def test_tau_is_the_mean_over_responses_of_each_responses_mean():
    greedy = [out([1] * 4), out([1] * 4)]
    short, long = out([4]), out([1, 1, 1, 1, 1, 1, 1])
    metrics = summarize_method([short, long], greedy, seed=0)
    assert metrics["acceptance_length"] == pytest.approx((4 + 1) / 2)
    assert metrics["acceptance_length_pooled"] == pytest.approx(11 / 8)
    lo, hi = metrics["acceptance_length_ci95"]
    assert 1.0 <= lo <= hi <= 4.0


def test_speedup_is_decode_time_per_token_without_the_prefill():
    greedy = [out([1] * 9, decode_s=9.0, prefill_s=5.0)]  # 10 tokens, 0.9 s each
    spec = [out([5, 4], decode_s=3.0, prefill_s=5.0)]  # 10 tokens, 0.3 s each
    metrics = summarize_method(spec, greedy, seed=0)
    assert metrics["speedup"] == pytest.approx(3.0)
    assert metrics["speedup_wall"] == pytest.approx(14 / 8)


def test_one_token_answers_give_no_speedup_and_no_interval_rather_than_nan():
    # Every answer is one token: nothing decoded to time, no verification step to resample.
    one = GenerateOutput(tokens=[7])
    metrics = summarize_method([one], [one], seed=0)
    assert metrics["speedup"] is None and metrics["acceptance_length_ci95"] == []
    json.dumps(metrics, allow_nan=False)  # what write_json_atomic demands


def test_bootstrap_interval_is_seeded_and_brackets_the_mean():
    values = np.array([1.0, 2.0, 3.0, 4.0, 10.0])
    a, b = bootstrap_interval(values, 7), bootstrap_interval(values, 7)
    assert a == b
    assert a[0] < values.mean() < a[1]


def test_ngram_lookup_takes_the_longest_suffix_at_its_most_recent_occurrence():
    history = [1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3]
    # "2 3" is the longest suffix seen before; its latest earlier occurrence is followed by 7.
    assert ngram_lookup(history, 4, 3) == [7, 5, 2]
    assert ngram_lookup([4, 5, 6], 4, 3) == []
    assert ngram_lookup([8, 1, 2, 3, 4, 8, 1, 2, 3, 4], 4, 15) == [8, 1, 2, 3, 4]


def test_loop_detection():
    assert ends_in_loop("i am not sure what you mean i am not sure what you mean".split())
    assert ends_in_loop([7] * 8)
    assert not ends_in_loop("that is a good question and i like it a lot".split())
    assert not ends_in_loop([7] * 5)
    assert text_ends_in_loop("\n" * 48) and text_ends_in_loop("I" * 48)
    assert text_ends_in_loop("no way i am fine i am fine")
    assert not text_ends_in_loop("I'm") and not text_ends_in_loop("well, see you soon!")


def test_loss_by_tercile_weights_and_splits_by_length():
    lengths = [10, 11, 50, 51, 100, 101]
    sums = [(1.0, 1.0), (3.0, 1.0), (2.0, 1.0), (2.0, 1.0), (9.0, 3.0), (0.0, 0.0)]
    result = loss_by_tercile(lengths, sums)
    assert result["heldout_loss_by_length"] == pytest.approx(
        {"short": 2.0, "medium": 2.0, "long": 3.0}
    )
    assert result["heldout_loss"] == pytest.approx(17 / 7)


def test_evaluate_stage_on_a_trained_tiny_drafter(tiny_workspace):
    single = ["train.world_size=1", "train.epochs=1"]
    run_stages(tiny_workspace, ["plan", "train", "evaluate"], single)
    metrics = json.loads((tiny_workspace / "metrics/eval_details.json").read_text())
    assert metrics["lossless_mismatches"] == 0
    assert metrics["n_prompts"] > 0
    assert 1.0 <= metrics["acceptance_length"] <= 4.0
    assert 1.0 <= metrics["acceptance_length_pooled"] <= 4.0
    assert len(metrics["per_position_acceptance"]) == 3
    for name in ("ngram", "untrained"):
        base = metrics["baselines"][name]
        assert 1.0 <= base["acceptance_length"] <= 4.0
        assert base["lossless_mismatches"] == 0 and base["speedup"] > 0
    assert set(metrics["heldout_loss_by_length"]) == {"short", "medium", "long"}
    assert 0.0 <= metrics["answer_cap_fraction"] <= 1.0
    rows = list(csv.DictReader(open(tiny_workspace / "plots/eval/acceptance.csv")))
    assert [int(r["position"]) for r in rows] == [1, 2, 3]
    live = json.loads((tiny_workspace / "dvclive/evaluate/metrics.json").read_text())
    assert live["acceptance_length"] == metrics["acceptance_length"]
    assert "ngram_acceptance_length" in live
    headline = json.loads((tiny_workspace / "metrics/eval.json").read_text())
    assert headline["acceptance_length"] == metrics["acceptance_length"]
    assert headline["baselines"]["ngram"] == {"acceptance_length": base_tau("ngram", metrics)}
    low, high = metrics["acceptance_length_ci95"]
    assert (headline["acceptance_length_ci95_low"], headline["acceptance_length_ci95_high"]) == (
        low,
        high,
    )


def base_tau(name: str, metrics: dict) -> float:
    return metrics["baselines"][name]["acceptance_length"]
