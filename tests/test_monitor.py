"""Training reports its stability and streams its curves to DVCLive (rank 0 only)."""

import json

import pytest
from conftest import run_stages


@pytest.mark.slow
def test_train_writes_stability_and_dvclive(tiny_workspace):
    run_stages(tiny_workspace, ["plan", "train"], ["train.world_size=1", "train.epochs=1"])
    metrics = json.loads((tiny_workspace / "metrics/train.json").read_text())
    assert isinstance(metrics["loss_spikes"], int) and metrics["loss_spikes"] >= 0
    assert metrics["grad_norm_cv"] > 0
    live = json.loads((tiny_workspace / "dvclive/train/metrics.json").read_text())
    assert live["final_loss"] == metrics["final_loss"]
    assert live["train"]["loss"] > 0  # the last logged row
    curve = (tiny_workspace / "dvclive/train/plots/metrics/train/loss.tsv").read_text()
    assert len(curve.splitlines()) - 1 == metrics["steps"]  # logging.every = 1 in the fixture
