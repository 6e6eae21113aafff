"""Acceptance and speed figures as the field reports them, from decoded responses.

τ follows z-lab's ``benchmark.py``: each response's mean of committed tokens per verification
step (accepted drafts + the bonus token), then the mean over responses, so a long response
weighs as much as a short one. The pooled mean over all steps is kept beside it, and so is
``acceptance_length_zlab``: the same mean of z-lab's per-step count, every draft the target
agreed with in the last block even past the stop token or the budget (the project commits and
counts only up to them), which reads higher on short answers. Speedup is
decode time per output token (the prefill excluded) of plain greedy over the method's, each
averaged over responses, as the reference does; the wall-clock ratio is its own key.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch stays out of the report and publish, which read these figures back
    from dflash.model.generate import GenerateOutput

BOOTSTRAP_SAMPLES = 1000
"""Resamples of the prompts for the 95% interval of τ."""


def response_tau(outputs: list[GenerateOutput], count: str = "accepted") -> np.ndarray:
    """Mean tokens per verification step of each response that had a step; ``count`` is
    ``accepted`` (committed) or ``agreed`` (z-lab's count)."""
    return np.array([np.mean(getattr(o, count)) for o in outputs if o.accepted], dtype=float)


def bootstrap_interval(values: np.ndarray, seed: int) -> list[float]:
    """95% percentile interval of the mean of ``values``, resampled with replacement; empty
    when no response had a step (JSON holds no NaN)."""
    if len(values) == 0:
        return []
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(values), size=(BOOTSTRAP_SAMPLES, len(values)))
    means = values[picks].mean(axis=1)
    return [float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))]


def acceptance_by_position(outputs: list[GenerateOutput], block_size: int) -> list[float]:
    """Share of whole-block steps whose draft slot k (1..bs-1) was accepted.

    Steps cut short by ``max_new_tokens`` or by a stop token are left out: their unused slots
    were never rejected by the target.
    """
    drafted = np.array(
        [a - 1 for o in outputs for a, full in zip(o.accepted, o.full, strict=True) if full]
    )
    return [float((drafted >= k).mean()) if len(drafted) else 0.0 for k in range(1, block_size)]


def time_per_token(outputs: list[GenerateOutput]) -> float:
    """Mean over responses of decode seconds per output token (the prefill excluded)."""
    per = [o.decode_s / len(o.tokens) for o in outputs if len(o.tokens) > 1]
    return float(np.mean(per)) if per else float("nan")


def speedup(greedy_s: float, method_s: float) -> float | None:
    """Greedy's time per token over the method's; None when either had no decoded token to
    time (every answer one token long): no figure rather than a NaN in the metrics."""
    ratio = greedy_s / max(method_s, 1e-12)
    return ratio if math.isfinite(ratio) else None


def wall_seconds(outputs: list[GenerateOutput]) -> float:
    return sum(o.prefill_s + o.decode_s for o in outputs)


def summarize_method(
    outputs: list[GenerateOutput], greedy: list[GenerateOutput], seed: int
) -> dict:
    """τ (per response, pooled, 95% interval) and speedups of one method against greedy."""
    steps = [a for o in outputs for a in o.accepted]
    taus, zlab = response_tau(outputs), response_tau(outputs, "agreed")
    return {
        "acceptance_length": float(taus.mean()) if len(taus) else 0.0,
        "acceptance_length_zlab": float(zlab.mean()) if len(zlab) else 0.0,
        "acceptance_length_pooled": float(np.mean(steps)) if steps else 0.0,
        "acceptance_length_ci95": bootstrap_interval(taus, seed),
        "speedup": speedup(time_per_token(greedy), time_per_token(outputs)),
        "speedup_wall": wall_seconds(greedy) / max(wall_seconds(outputs), 1e-12),
        "target_forwards": len(steps),
    }
