"""The objective's position weights, one module each: ``objective.position_weight`` picks one.

Each module defines ``POSITION_WEIGHT = PositionWeight(name=..., ...)`` and documents it in
its docstring's first paragraph; ``dflash.model.position_weights`` finds it. They live inside
``dflash.objectives`` because they are the objective's other half, chosen in its params
section, yet a separate extension point: any loss combines with any weighting.

A weighting gives either each block slot's weight, known before the forward (the data loader
then sums the weights to normalise the loss, and a loss may take its fused kernel), or block
weights from the drafter's confidence in each label, computed in the forward (every label then
weighs 1 ahead, and the loss is normalised by the label count).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class PositionWeight:
    """Exactly one of ``slots`` and ``confidence``."""

    name: str
    slots: Callable[[int, float], Tensor] | None = None
    """``(block_size, drafter.gamma) -> [bs]`` float32 weights of the block slots, 0 for the
    anchor's own."""
    confidence: Callable[[Tensor, Tensor, Any], Tensor] | None = None
    """``(confidence, counted, objective) -> [B, bs]`` weights of blocks from the drafter's
    probability of each label ``[B, bs]``, where labels count (bool) and the configured
    ``Objective`` (its params); 0 where none counts, and no gradient."""

    def __post_init__(self) -> None:
        if (self.slots is None) == (self.confidence is None):
            raise ValueError(f"position weight {self.name!r}: give slots or confidence, not both")

    def blocks(self, confidence: Tensor, counted: Tensor, objective: Any, gamma: float) -> Tensor:
        """``[B, bs]`` weights of whole blocks, whichever kind this weighting is."""
        if self.slots is not None:
            return self.slots(counted.shape[-1], gamma).to(counted.device) * counted
        return self.confidence(confidence, counted, objective)

    def labels(self, index: Tensor, shape: tuple[int, int], objective: Any):
        """``confidence [L] -> weights [L]`` of the labels at ``index`` among ``shape``'s
        ``[B, bs]`` block slots."""

        def reweigh(confidence: Tensor) -> Tensor:
            dense = confidence.new_zeros(shape).flatten()
            counted = torch.zeros(dense.shape, dtype=torch.bool, device=dense.device)
            dense[index], counted[index] = confidence, True
            return self.confidence(dense.view(shape), counted.view(shape), objective).flatten()[
                index
            ]

        return reweigh
