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


def projected_hours(
    plan_tokens: int, done_tokens: int, elapsed_s: float, timed: list[tuple[float, int]]
) -> float | None:
    """Hours the full run takes: the seconds trained so far, plus the plan's remaining real
    tokens (every epoch's) at the rate of the later half of this process's steps past
    warm-up. The early steps are left out because they run slower than the rest (kernels
    for each new batch shape, the allocator's cache), which a short pilot would project
    over the whole run. A finished full run projects its own time; None when unmeasured."""
    late = timed[len(timed) // 2 :]
    seconds, tokens = sum(s for s, _ in late), sum(n for _, n in late)
    if not late:
        seconds, tokens = elapsed_s, done_tokens
    if not (seconds > 0 and tokens > 0):
        return None
    left = max(plan_tokens - done_tokens, 0)
    return (elapsed_s + left * seconds / tokens) / SECONDS_PER_HOUR
