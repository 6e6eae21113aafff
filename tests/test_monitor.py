"""Training reports its stability and streams its curves to DVCLive (rank 0 only)."""

import csv
import json
import os
import subprocess
import sys

import pytest
from conftest import run_stages

from dflash.train.observe.monitor import wandb_quiet


def spikes(losses: list[float]) -> int:
    """Spikes by their definition, counted without the code under test: from the tenth step
    on (the first fall fast), a loss above twice the median of the up to fifty steps before it."""
    count = 0
    for i in range(10, len(losses)):
        window = sorted(losses[max(0, i - 50) : i])
        half = len(window) // 2
        median = window[half] if len(window) % 2 else (window[half - 1] + window[half]) / 2
        count += losses[i] > 2 * median
    return count


def spread(values: list[float]) -> float:
    """Population standard deviation over the mean, written out."""
    mean = sum(values) / len(values)
    return (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5 / mean


@pytest.mark.slow
def test_train_writes_stability_and_dvclive(tiny_workspace):
    run_stages(tiny_workspace, ["plan", "train"], ["train.world_size=1", "train.epochs=1"])
    metrics = json.loads((tiny_workspace / "metrics/train.json").read_text())
    steps = list(csv.DictReader(open(tiny_workspace / "plots/train/steps.csv")))
    assert len(steps) == metrics["steps"]  # every step of the tiny run is finite
    losses = [float(row["loss"]) for row in steps]
    norms = [float(row["grad_norm"]) for row in steps]
    # The figures are those of the run's own steps, not merely well-formed.
    assert metrics["loss_spikes"] == spikes(losses)
    assert metrics["grad_norm_cv"] == pytest.approx(spread(norms), rel=1e-9)
    assert metrics["grad_norm_cv"] > 0
    live = json.loads((tiny_workspace / "dvclive/train/metrics.json").read_text())
    assert live["final_loss"] == metrics["final_loss"]
    assert live["train"]["loss"] > 0  # the last logged row
    curve = (tiny_workspace / "dvclive/train/plots/metrics/train/loss.tsv").read_text()
    assert len(curve.splitlines()) - 1 == metrics["steps"]  # logging.every = 1 in the fixture


def test_wandb_stays_quiet_unless_its_environment_asks():
    assert wandb_quiet({}) == {"quiet": True}
    assert wandb_quiet({"WANDB_QUIET": "false"}) == {} == wandb_quiet({"WANDB_SILENT": "true"})


WANDB_RUN = """
import os, wandb
from dflash.train.observe.monitor import wandb_quiet
from dflash.train.observe.stability import coefficient_of_variation, count_spikes
run = wandb.init(project="p", mode="offline", dir=os.getcwd(),
                 settings=wandb.Settings(**wandb_quiet(os.environ)))
run.log({"loss": 1.0}, step=1)
run.summary.update({"final_loss": 1.0})
run.finish()
"""


@pytest.mark.slow
@pytest.mark.parametrize("env, shown", [({}, False), ({"WANDB_QUIET": "false"}, True)])
def test_an_offline_run_prints_no_summary_unless_asked(tmp_path, env, shown):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    out = subprocess.run(
        [sys.executable, "-c", WANDB_RUN], cwd=tmp_path, env={**environ, **env},
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    text = out.stdout + out.stderr
    assert ("Run summary" in text) == shown and ("final_loss" in text) == shown
