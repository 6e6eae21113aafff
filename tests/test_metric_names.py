"""The training metrics are one table (:mod:`dflash.metrics.names`): the metrics files' models,
the plot columns, the model card, the report and compare derive from it, and each producer
writes exactly its rows."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from dflash.commands import report
from dflash.commands.compare import paired
from dflash.features.sources.colocated import ColocatedFeatures
from dflash.metrics import names
from dflash.metrics.names import (
    COMPARE,
    FEATURES,
    HEADLINE,
    PLOT_COLUMNS,
    REPORT,
    SELECTOR,
    SERIES,
    STABILITY,
    SUMMARY,
    TRAIN,
    MetricTableError,
    plotted,
    shown,
    written_by,
)
from dflash.metrics.schema import TrainDetails, TrainHeadline, leaves
from dflash.model.card import TRAINING_KEYS
from dflash.train.checkpointing.state import TrainState
from dflash.train.observe.monitor import Monitor
from dflash.train.observe.summary import run_summary
from dflash.train.observe.window import Window


def test_every_list_of_training_metrics_is_the_tables():
    summary = {m.name for m in TRAIN if m.by is not None}
    assert list(TrainDetails.model_fields) == sorted(summary)
    assert leaves(TrainHeadline) == tuple(m.name for m in shown(HEADLINE))
    assert set(TRAINING_KEYS) <= summary
    cells = [(label, key) for row in report.TRAINING for label, key, _ in row]
    assert cells == [(m.label, m.name) for m in shown(REPORT)]
    assert list(paired.TRAIN_FIGURES) == [(m.label, m.name) for m in shown(COMPARE)]


def test_a_figure_has_one_name():
    assert "mean_sample_length" in PLOT_COLUMNS and "mean_sample_length" in names.STEP_COLUMNS
    assert not any(m.name == "mean_length" for m in TRAIN)


@pytest.mark.parametrize(
    "row, named",
    [
        (replace(TRAIN[0]), "step is listed twice"),
        (replace(TRAIN[0], name="x", shown=(HEADLINE,)), "x is shown, but no summary figure"),
        (replace(TRAIN[0], name="x", by=SUMMARY), "x: a summary figure needs a type"),
        (replace(TRAIN[0], name="x", type=int, by=SUMMARY, shown=(REPORT,)), "x: a figure on"),
    ],
)
def test_a_row_that_cannot_be_what_it_says_is_refused(row, named):
    with pytest.raises(MetricTableError, match=named):
        names.check((*TRAIN, row))


def _result() -> dict:
    return {
        "finite": True, "loss": 1.0, "weight": 2.0, "correct": torch.tensor([4, 3, 2]),
        "counted": torch.tensor([4, 4, 4]), "real_tokens": 10, "padded_tokens": 12,
        "n_samples": 2, "grad_norm": 0.5, "lr": 1e-3,
    }  # fmt: skip


def test_each_producer_writes_exactly_its_rows():
    window = Window()
    window.add(_result(), seconds=1.0, wait=0.1, length_class="short")
    assert {*window.row(step=1, epoch=0), "simulated_tau"} == {*PLOT_COLUMNS, *plotted(SERIES)}

    def summary_of(state):
        return run_summary(
            state, tau_seconds=None, plan_tokens=0, timed=[], planned_steps=1, epochs=1,
            world_size=1, drafter_sources=None,
        )  # fmt: skip

    selector = {f"final_{name}" for name in plotted(SELECTOR)}
    assert set(summary_of(TrainState())) == set(written_by(SUMMARY)) - selector
    walked = TrainState()
    walked.rows.append({"loss": 1.0} | {name: 0.5 for name in plotted(SELECTOR)})
    assert set(summary_of(walked)) == set(written_by(SUMMARY))

    balance = ColocatedFeatures(torch.nn.Identity(), []).finish()
    assert list(balance) == list(written_by(FEATURES))

    history = {name: [] for name in names.STEP_COLUMNS}
    figures = Monitor.stability(SimpleNamespace(history=history))
    assert list(figures) == list(written_by(STABILITY))
