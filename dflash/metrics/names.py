"""The names a training run writes, declared once. Those that end up in a metrics file are
held against its model when the trainer is built, so a misspelt one fails before the first step
rather than when the finished run writes ``metrics/train_details.json``; the tests hold each
producer's keys to its list here.
"""

from __future__ import annotations

from dflash.metrics.schema import TrainDetails, TrainHeadline, leaves
from dflash.model.card import TRAINING_KEYS

PLOT_COLUMNS = [
    "step",
    "epoch",
    "loss",
    "accuracy",
    "simulated_tau",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "padded_tokens_per_s",
    "padding_efficiency",
    "mean_sample_length",
    "data_wait_fraction",
]
"""The columns of ``plots/train/log.csv``: ``_Window.row``'s figures and
``Trainer._simulated_tau``'s."""
SERIES = ("per_position_accuracy", "loss_by_length")
"""A row's lists: the monitor logs them by position and by length class, never as columns."""
VAL_COLUMNS = ["val_loss", "val_accuracy", "val_simulated_tau"]
"""The validation figures (``train.eval_every``): columns of the log only when a row has them."""

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
        "null_reasons",
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
    """A name the run writes has no field in its file's model, or a field nothing fills."""


def check() -> None:
    """Raise :class:`MetricNameError` listing every summary name :class:`TrainDetails` has no
    field for, every field it requires that nothing writes, and every name its headline or
    the model card reads that it lacks."""
    details = TrainDetails.model_fields
    written = {name for names in SUMMARY.values() for name in names}
    problems = [
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
            "training metric names disagree with dflash/metrics/schema.py: " + "; ".join(problems)
        )
