"""A non-finite step changes no weight; ``train.max_nonfinite_steps`` in a row stop the run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import run_stages

from dflash.train import build, step
from dflash.train.step import TrainingError

NAN_STEPS = {1, 3, 4}
"""The steps (from 1) whose features are NaN: one alone, then two in a row."""
LIMIT = 2


def poisoned_features(source):
    """``source``'s features turned NaN: a real non-finite loss and gradients, not a faked one."""
    return lambda mb: source(mb) * float("nan")


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")
def test_nonfinite_steps_are_skipped_and_enough_in_a_row_stop_the_run(tiny_workspace, monkeypatch):
    weights: list[dict[str, torch.Tensor]] = []  # the drafter's, as each step begins
    real = step.forward_backward

    def poisoned(ctx, model, micro_batches, features, *rest):
        weights.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        if len(weights) in NAN_STEPS:
            features = poisoned_features(features)
        return real(ctx, model, micro_batches, features, *rest)

    monkeypatch.setattr(step, "forward_backward", poisoned)
    monkeypatch.setattr(build, "build_simulated", lambda *args: None)  # no held-out τ
    sets = ["train.world_size=1", f"train.max_nonfinite_steps={LIMIT}", "train.warmup_ratio=0"]
    with pytest.raises(TrainingError) as stopped:
        run_stages(tiny_workspace, ["plan", "train"], [*sets, "train.checkpoint_every=100"])
    message = str(stopped.value)
    assert f"{LIMIT} non-finite losses in a row" in message
    assert f"train.max_nonfinite_steps = {LIMIT}" in message

    def same(a: dict, b: dict) -> bool:
        return all(torch.equal(a[k], b[k]) for k in a)

    assert same(weights[0], weights[1])  # step 1 skipped: no update, no weight decay
    # Step 3 was the second non-finite step but the first in a row: the run went on to step 4.
    assert len(weights) == 4
    assert not same(weights[1], weights[2])  # step 2 finite: updated
    assert same(weights[2], weights[3])  # step 3 skipped
    assert all(torch.isfinite(v).all() for v in weights[3].values())
    assert not (tiny_workspace / "models/drafter").exists()


def test_a_run_that_stops_ends_in_one_line_and_exit_1(monkeypatch, capsys):
    """The exit-status table (docs/pipeline.md): a run that cannot go on is one line, exit 1."""
    from dflash import cli

    def stopped(*args, **kwargs):
        raise TrainingError("2 non-finite losses in a row (train.max_nonfinite_steps = 2)")

    monkeypatch.setattr(cli, "run_stage", stopped)
    params = Path(__file__).parents[1] / "params.yaml"
    assert cli.main(["train", "--params", str(params)]) == 1
    err = capsys.readouterr().err
    assert err == "dflash train: 2 non-finite losses in a row (train.max_nonfinite_steps = 2)\n"
