"""``dpace``: D-PACE, slot k weighs the expected tokens accepted from k on given the drafter's
confidence in the labels (loss normalised by the label count).

As speculators defines it: with ``q_j`` the drafter's probability of slot ``j``'s label,
smoothed to ``s_j = (1 - alpha) q_j + alpha`` (``objective.dpace_alpha``),
``w_k = Σ_{t >= k} Π_{j <= t} s_j`` over the block's counted slots. The weights carry no
gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dflash.objectives.weights import PositionWeight


def dpace_weights(confidence: Tensor, counted: Tensor, alpha: float) -> Tensor:
    """``[B, bs]`` D-PACE weights of blocks whose slots have ``confidence`` (the drafter's
    probability of the label) where ``counted``; 0 elsewhere. A slot that does not count
    neither weighs nor lowers the odds of reaching the later ones."""
    counts = counted.to(confidence.dtype)
    smooth = torch.where(counted, (1.0 - alpha) * confidence + alpha, 1.0)
    reach = torch.cumprod(smooth, dim=-1) * counts
    return reach.flip(-1).cumsum(-1).flip(-1) * counts


def weights(confidence: Tensor, counted: Tensor, objective) -> Tensor:
    return dpace_weights(confidence, counted, objective.dpace_alpha)


POSITION_WEIGHT = PositionWeight(name="dpace", confidence=weights)
