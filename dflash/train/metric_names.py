"""The names a training run writes, declared once and held against the files they end up in
when the trainer is built: a misspelt name fails before the first step, not when the finished
run writes its metrics hours later.

A log row's figures become the columns of ``plots/train/log.csv`` (:data:`PLOT_COLUMNS` and
:data:`VAL_COLUMNS`); the run's summary becomes ``metrics/train_details.json``
(:class:`TrainDetails`), whose headline and model-card figures are some of its fields. The
tests hold each producer's keys to its list here.
"""

from __future__ import annotations

from dflash.metrics_schema import TrainDetails, TrainHeadline, leaves
from dflash.model.card import TRAINING_KEYS
from dflash.train.monitor import PLOT_COLUMNS, VAL_COLUMNS

ROW = (
    "step",
    "epoch",
    "loss",
    "accuracy",
    "per_position_accuracy",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "padded_tokens_per_s",
    "padding_efficiency",
    "mean_sample_length",
    "data_wait_fraction",
    "loss_by_length",
    "simulated_tau",
)
"""A log row: ``_Window.row``'s figures and ``Trainer._simulated_tau``'s; validation rows add
:data:`VAL_COLUMNS`."""
SERIES = ("per_position_accuracy", "loss_by_length")
"""A row's lists: the monitor logs them by position and by length class, never as columns."""

SUMMARY = {
    "Trainer._summary": (
        "restarts",
        "final_loss",
        "final_accuracy",
        "final_simulated_tau",
        "simulated_tau_cost",
        "tokens_per_s",
        "padded_tokens_per_s",
        "projected_hours",
        "padding_efficiency",
        "data_wait_fraction",
        "steps",
        "planned_steps",
        "skipped_steps",
        "epochs",
        "world_size",
        "train_seconds",
        "flex_compiles",
        "drafter_sources",
    ),
    "the feature source's finish()": (
        "target_idle_fraction",
        "drafter_wait_fraction",
        "target_forwards",
    ),
    "Monitor.stability": ("loss_spikes", "grad_norm_cv", "loss_length_corr"),
    "train.keep_best": ("best_step", "best_val_simulated_tau"),
    "the export": ("drafter_sha256",),
}
"""The summary's names by what adds them: together, ``metrics/train_details.json``."""


class MetricNameError(RuntimeError):
    """A name the run writes has no place in its file, or a place nothing fills."""


def check() -> None:
    """Raise :class:`MetricNameError` listing every mismatch between the names above and the
    log's columns, :class:`TrainDetails`, its headline and the model card."""
    columns = [*PLOT_COLUMNS, *VAL_COLUMNS, *SERIES]
    details = TrainDetails.model_fields
    written = {name for names in SUMMARY.values() for name in names}
    problems = [
        f"a log row's {name!r} is no column of plots/train/log.csv ({', '.join(columns)})"
        for name in ROW
        if name not in columns
    ]
    problems += [
        f"the log column {name!r} is in no row" for name in PLOT_COLUMNS if name not in ROW
    ]
    problems += [
        f"{producer} writes {name!r}, which TrainDetails has no field for"
        for producer, names in SUMMARY.items()
        for name in names
        if name not in details
    ]
    problems += [
        f"TrainDetails requires {name!r}, which nothing writes"
        for name, field in details.items()
        if field.is_required() and name not in written
    ]
    shown = {"TrainHeadline": leaves(TrainHeadline), "the model card": TRAINING_KEYS}
    problems += [
        f"{reader} reads {name!r}, which TrainDetails has no field for"
        for reader, names in shown.items()
        for name in names
        if name not in details
    ]
    if problems:
        raise MetricNameError(
            "training metric names disagree with dflash/metrics_schema.py: " + "; ".join(problems)
        )
