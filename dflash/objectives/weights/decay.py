"""``decay``: block slot k weighs exp(-(k-1)/drafter.gamma) (the paper); early slots matter most,
since a rejection ends the block."""

from __future__ import annotations

import torch
from torch import Tensor

from dflash.objectives.weights import PositionWeight


def decay_weights(block_size: int, gamma: float) -> Tensor:
    """``[bs]`` weights: 0 for slot 0 (the given anchor), ``exp(-(k-1)/gamma)`` for k >= 1."""
    k = torch.arange(block_size, dtype=torch.float64)
    weights = torch.exp(-(k - 1) / gamma)
    weights[0] = 0.0
    return weights.float()


POSITION_WEIGHT = PositionWeight(name="decay", slots=decay_weights)
