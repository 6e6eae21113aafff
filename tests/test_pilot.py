"""Pilots and batch composition: step limits, the projection, the loss-length correlation."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dflash.train.observe.composition import class_name, length_classes, ranks, spearman
from dflash.train.observe.monitor import steps_to_csv
from dflash.train.observe.pilot import epoch_limits, projected_hours


def test_a_pilot_runs_the_first_max_steps_of_the_run_across_epochs():
    assert epoch_limits([4, 4, 4], None) == [4, 4, 4]
    assert epoch_limits([4, 4, 4], 6) == [4, 2, 0]
    assert epoch_limits([4, 4, 4], 0) == [0, 0, 0]
    assert epoch_limits([4, 4], 99) == [4, 4]


def test_the_projection_adds_the_remaining_tokens_at_the_later_steps_rate():
    timed = [(4.0, 100), (2.0, 100), (1.0, 100), (1.0, 100)]  # the first steps run slower
    # 8 s so far, 400 of 2,000 tokens done; the rest at the later half's 100 tokens/s.
    assert projected_hours(2000, 400, 8.0, timed) * 3600 == pytest.approx(8.0 + 16.0)
    assert projected_hours(400, 400, 8.0, timed) * 3600 == pytest.approx(8.0)  # a full run
    assert projected_hours(2000, 100, 2.0, []) * 3600 == pytest.approx(40.0)  # all warm-up
    assert projected_hours(2000, 0, 0.0, []) is None


def test_spearman_ranks_ties_and_refuses_what_means_nothing():
    assert ranks(np.array([3.0, 1.0, 3.0])).tolist() == [2.5, 1.0, 2.5]
    assert spearman([1, 2, 3, 4], [10, 20, 40, 80]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [8, 4, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2], [1, 2]) is None
    assert spearman([1, 2, 3], [5, 5, 5]) is None


def test_length_classes_are_the_stats_stages_quantile_buckets(tmp_path):
    path = tmp_path / "buckets.json"
    path.write_text(json.dumps({"quantile": {"boundaries": [32, 64, 96]}}))
    edges = length_classes(path)
    assert [class_name(edges, n) for n in (1, 32, 33, 96, 200)] == [
        "1-32", "1-32", "33-64", "65-96", "65-96"
    ]  # fmt: skip
    assert length_classes(tmp_path / "missing.json") == [] and class_name([], 5) is None


def test_step_csv_pairs_each_loss_with_its_mean_sample_length():
    history = {"step": [1, 3], "loss": [2.0, 1.5], "mean_sample_length": [40.0, 80.0],
               "grad_norm": [1, 2]}  # fmt: skip
    assert steps_to_csv(history).splitlines() == [
        "step,loss,grad_norm,mean_sample_length", "1,2.0,1,40.0", "3,1.5,2,80.0"
    ]  # fmt: skip
    header = "step,loss,grad_norm,mean_sample_length"
    assert steps_to_csv({"loss": [1.0]}).splitlines() == [header]
