"""Training stability per batching strategy: did the loss spike, how erratic were the gradients?

Length-sorted batches can make the loss jump (from ~0.9 to 4.6-6.4) at batch boundaries. A spike is
a step whose loss exceeds twice the median of the previous ``SPIKE_WINDOW`` steps; the grad-norm
coefficient of variation (std / mean over all steps) measures how uneven the updates were. Both are
comparable across batching strategies.
"""

from __future__ import annotations

import numpy as np

SPIKE_WINDOW = 50
SPIKE_FACTOR = 2.0
MIN_HISTORY = 10
"""Steps needed before a median means anything (the first steps fall fast)."""


def is_spike(losses: list[float], i: int) -> bool:
    """Whether step ``i``'s loss exceeds ``SPIKE_FACTOR`` × the median of the steps before it."""
    if i < MIN_HISTORY:
        return False
    return losses[i] > SPIKE_FACTOR * float(np.median(losses[max(0, i - SPIKE_WINDOW) : i]))


def count_spikes(losses: list[float]) -> int:
    return sum(is_spike(losses, i) for i in range(len(losses)))


def coefficient_of_variation(values: list[float]) -> float | None:
    if len(values) < 2 or np.mean(values) == 0:
        return None
    return float(np.std(values) / np.mean(values))


def stability(history: dict[str, list[float]]) -> dict:
    """``loss_spikes`` and ``grad_norm_cv`` of the finite steps recorded in ``history``."""
    return {
        "loss_spikes": count_spikes(history.get("loss", [])),
        "grad_norm_cv": coefficient_of_variation(history.get("grad_norm", [])),
    }
