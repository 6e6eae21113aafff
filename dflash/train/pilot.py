"""Pilot runs: the first ``train.max_steps`` steps of a full run, and what they project.

A pilot keeps the full run's plan and learning-rate schedule and only stops early, so its
steps are the full run's first steps. Drafter ranks and decoupled target ranks derive the
same per-epoch step counts from the plan's summary, so both sides stop at the same
micro-batch and nobody waits for features that never come.
"""

from __future__ import annotations

SECONDS_PER_HOUR = 3600.0


def epoch_limits(epoch_steps: list[int], max_steps: int | None) -> list[int]:
    """Steps each epoch runs: every planned one, or the run's first ``max_steps`` in total."""
    if max_steps is None:
        return list(epoch_steps)
    out, left = [], max_steps
    for n in epoch_steps:
        out.append(min(n, left))
        left -= out[-1]
    return out


def projected_hours(plan_tokens: int, tokens_per_s: float) -> float | None:
    """Hours the full run takes at the measured rate: every epoch's real tokens of the plan
    over the real tokens per second past warm-up, on the plan's ranks (None unmeasured)."""
    if not tokens_per_s > 0:
        return None
    return plan_tokens / tokens_per_s / SECONDS_PER_HOUR
