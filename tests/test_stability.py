"""Loss spikes and grad-norm spread: measured the same for every strategy."""

import pytest

from dflash.train.observe.stability import MIN_HISTORY, count_spikes, stability


def test_a_spike_is_a_loss_above_twice_the_recent_median():
    losses = [1.0] * 20 + [2.5] + [1.0] * 5 + [1.9]
    assert count_spikes(losses) == 1


def test_early_steps_and_a_falling_loss_are_not_spikes():
    assert count_spikes([9.0, 1.0] + [5.0] * (MIN_HISTORY - 3)) == 0
    assert count_spikes([8.0 / (1 + i) for i in range(100)]) == 0


def test_only_the_last_fifty_steps_set_the_median():
    losses = [5.0] * 60 + [1.0] * 50 + [2.5]
    assert count_spikes(losses) == 1  # 2.5 is below the old 5.0s, but twice the recent 1.0s
    assert stability({"loss": [], "grad_norm": []}) == {"loss_spikes": 0, "grad_norm_cv": None}


def test_grad_norm_cv_is_std_over_mean():
    figures = stability({"loss": [1.0], "grad_norm": [1.0, 3.0]})
    assert figures["grad_norm_cv"] == pytest.approx(0.5)
