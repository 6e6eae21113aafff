"""The figures a run ends with: what its state counted, as ``metrics/train_details.json`` holds
them (the rows :data:`dflash.metrics.names.SUMMARY` adds).

A figure with nothing to give it, or a non-finite one, is None (JSON null, never NaN), and
``null_reasons`` says why.
"""

from __future__ import annotations

import math
import os
from typing import Any

from dflash.metrics.names import SELECTOR, plotted
from dflash.model.drafter_attention import flex_compiles
from dflash.train.checkpointing.state import TrainState
from dflash.train.observe.pilot import projected_hours

NO_STEP = "no optimizer step ran (train.max_steps: 0)"
NO_FINITE_STEP = "no step had a finite loss (every step was skipped)"
NO_HELDOUT = "no held-out batch to measure it on (an engine run, or no held-out prompts)"
NOT_FINITE = "it came out non-finite"


def run_summary(
    s: TrainState,
    *,
    tau_seconds: float | None,
    plan_tokens: int,
    timed: list[tuple[float, int]],
    planned_steps: int,
    epochs: int,
    world_size: int,
    drafter_sources: dict[str, str] | None,
) -> dict[str, Any]:
    """The run's figures from its state. ``tau_seconds``: the time τ's held-out batch took
    (None: there was none); ``timed``: ``(seconds, real tokens)`` of the steps past warm-up."""
    finals, null_reasons = final_figures(s, tau_seconds is not None)
    return {
        "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        **finals,
        "simulated_tau_cost": (tau_seconds or 0.0) / max(s.elapsed_s, 1e-9),
        **throughput(s),
        "projected_hours": projected_hours(plan_tokens, s.real_tokens, s.elapsed_s, timed),
        "padding_efficiency": s.real_tokens / max(s.padded_tokens, 1),
        "data_wait_fraction": s.data_wait_s / max(s.elapsed_s, 1e-9),
        "steps": s.global_step,
        "planned_steps": planned_steps,
        "skipped_steps": s.skipped_steps,
        "epochs": epochs,
        "world_size": world_size,
        "train_seconds": s.elapsed_s,
        "flex_compiles": flex_compiles(),
        "drafter_sources": drafter_sources,
    } | ({"null_reasons": null_reasons} if null_reasons else {})


def final_figures(s: TrainState, measured_tau: bool) -> tuple[dict[str, Any], dict[str, str]]:
    """The last epoch's loss and the last row's accuracy and τ; a figure with nothing to give
    it, or a non-finite one, is None (JSON null, never NaN), and the second dict says why."""
    last_epoch = max((e for e, _, _ in s.epoch_loss), default=0)
    last = [(loss, w) for e, loss, w in s.epoch_loss if e == last_epoch]
    weight = sum(w for _, w in last)
    last_row = next((row for row in reversed(s.rows) if "loss" in row), {})
    no_row = NO_STEP if s.global_step == 0 else "no step was logged"
    figures = {
        "final_loss": (sum(loss * w for loss, w in last) / weight if weight else None,
                       NO_STEP if s.global_step == 0 else NO_FINITE_STEP),
        "final_accuracy": (last_row.get("accuracy"), no_row),
        "final_simulated_tau": (last_row.get("simulated_tau"),
                                no_row if not last_row or measured_tau else NO_HELDOUT),
    }  # fmt: skip
    values, reasons = {}, {}
    for name in plotted(SELECTOR):  # a selector's figures, absent without one
        if name in last_row:
            figures[f"final_{name}"] = (last_row[name], no_row)
    for key, (value, why) in figures.items():
        finite = value is not None and math.isfinite(value)
        values[key] = value if finite else None
        if not finite:
            reasons[key] = why if value is None else NOT_FINITE
    return values, reasons


def throughput(s: TrainState) -> dict[str, float]:
    """Tokens per second past warm-up; over every step when the run was all warm-up."""
    if s.timed_s > 0:
        seconds, real, padded = s.timed_s, s.timed_real_tokens, s.timed_padded_tokens
    else:
        seconds, real, padded = s.elapsed_s, s.real_tokens, s.padded_tokens
    return {
        "tokens_per_s": real / max(seconds, 1e-9),
        "padded_tokens_per_s": padded / max(seconds, 1e-9),
    }
